"""Clean shutdown: AsyncLLMEngine.shutdown() fails what is open instead of leaving it hanging."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mini_infer import LLMEngine, SamplingParams
from mini_infer.engine.async_engine import AsyncLLMEngine, EngineShutdownError

LONG = dict(max_tokens=4000, ignore_eos=True)  # far longer than any test waits


def test_shutdown_fails_open_streams_and_queued_adds(tiny_model_dir):
    """A stream mid-generation and an add still queued when the engine stops both raise, neither hangs; later
    requests are refused with the same error."""
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32"))
    gate, step = threading.Event(), engine.engine.step

    def gated_step():
        gate.wait()
        return step()

    async def scenario():
        streaming = engine.generate("open", "hello", SamplingParams(**LONG))
        await anext(streaming)
        engine.engine.step = gated_step  # the engine thread now holds in its next step
        stopping = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))
        await asyncio.sleep(0.2)  # shutdown() has queued its stop command
        queued = asyncio.ensure_future(anext(engine.generate("queued", "hi", SamplingParams(**LONG))))
        await asyncio.sleep(0.2)  # the add is queued behind the stop: the thread will never take it
        gate.set()
        with pytest.raises(EngineShutdownError):
            async for _ in streaming:
                pass
        with pytest.raises(EngineShutdownError):
            await queued
        await stopping
        with pytest.raises(EngineShutdownError):
            await anext(engine.generate("late", "hi", SamplingParams(max_tokens=2)))

    asyncio.run(asyncio.wait_for(scenario(), 60))
