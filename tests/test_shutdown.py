"""Clean shutdown: AsyncLLMEngine.shutdown() fails what is open instead of leaving it hanging, and `mini-infer
serve` under streaming load drains on SIGTERM / SIGINT, ends every stream with an error event and [DONE], and
exits leaving no process behind (also data and tensor parallel)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import descendants, processes
from mini_infer import LLMEngine, SamplingParams
from mini_infer.engine.async_engine import AsyncLLMEngine, EngineShutdownError
from mini_infer.entrypoints.cli import main

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


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_negative_shutdown_timeout_is_refused_by_name(tiny_model_dir, value, capsys):
    assert main(["serve", "--model", str(tiny_model_dir), "--shutdown-timeout", value]) == 2
    assert f"--shutdown-timeout must be >= 0, got {float(value)}" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(model_dir, *flags: str, attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """`mini-infer serve` in its own session (so its process group is exactly what it started), once healthy.

    The port is free when chosen but the server binds it only after its engine is up; meanwhile a tensor-parallel
    engine's ranks open connections on ephemeral ports and can take it (then the server exits, "address already in
    use"): a harness race, so that case alone starts again on another port."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "mini_infer.entrypoints.cli", "serve", "--model", str(model_dir),
                                "--dtype", "float32", "--port", str(port), *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            errors = process.communicate()[1]
            if "address already in use" in errors and attempts > 1:
                return _serve(model_dir, *flags, attempts=attempts - 1)
            raise AssertionError(errors)
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)


def _load(url: str, results: dict, streaming: int, started: threading.Semaphore,
          max_tokens: int = LONG["max_tokens"]) -> list[threading.Thread]:
    """`streaming` streams and one non-streaming request, each in a thread; a stream's result is its status and
    data lines, the other's its status and body; `started` is released once per stream under way."""
    body = {**LONG, "max_tokens": max_tokens}

    def stream(i):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": f"stream {i}", "stream": True, **body}) as response:
            lines = []
            for line in response.iter_lines():
                if line and not lines:
                    started.release()
                lines += [line] if line else []
        results[i] = response.status_code, lines

    def whole():
        response = httpx.post(url + "/v1/completions", json={"prompt": "whole", **body}, timeout=60)
        results["whole"] = response.status_code, response.json()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streaming)] + [threading.Thread(target=whole)]
    for thread in threads:
        thread.start()
    return threads


def _requests_in_engine(url: str) -> int:
    """Running plus waiting requests, from /metrics."""
    lines = httpx.get(url + "/metrics", timeout=5).text.splitlines()
    return sum(int(float(line.split()[-1])) for line in lines
               if line.startswith(("mini_infer:num_requests_running{", "mini_infer:num_requests_waiting{")))


def _check_ended_cleanly(results: dict, streaming: int) -> None:
    """Each stream finished or ended with a 503 error event then [DONE]; the whole request got a 503 or 200."""
    for i in range(streaming):
        status, lines = results[i]
        assert status == 200 and lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        if "error" in last:
            assert last["error"]["code"] == 503 and last["error"]["type"] == "service_unavailable"
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    status, body = results["whole"]
    assert status == 200 or (status == 503 and body["error"]["message"].startswith("the server is shutting down"))


def _check_nothing_left(process: subprocess.Popen, stderr: str) -> None:
    assert process.returncode == 0, stderr
    for bad in ("Traceback", "Event loop is closed", "ERROR"):
        assert bad not in stderr, stderr
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves just after its parent
    while [pid for pid, state, _, group, _ in processes() if group == process.pid and state != "Z"]:
        assert time.monotonic() < deadline, "processes of the server's group outlived it"
        time.sleep(0.1)


# Each signal once and each layout once: the server takes SIGTERM and SIGINT in one handler, and a signal reaches
# the server's own process whatever runs under it (~5 s a case).
@pytest.mark.parametrize("sig, dp", [(signal.SIGTERM, 1), (signal.SIGINT, 2)], ids=["SIGTERM-dp1", "SIGINT-dp2"])
def test_signal_drains_then_aborts_and_exits(tiny_model_dir, sig, dp):
    process, url = _serve(tiny_model_dir, "--shutdown-timeout", "1", "--data-parallel-size", str(dp))
    try:
        assert len(descendants(process.pid)) >= (2 if dp == 2 else 0)
        results, started = {}, threading.Semaphore(0)
        threads = _load(url, results, 8, started)
        for _ in range(8):
            assert started.acquire(timeout=60)
        sent = time.monotonic()
        process.send_signal(sig)
        while (refused := httpx.get(url + "/health", timeout=5)).status_code == 200:  # until the signal lands
            time.sleep(0.02)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503  # new requests: refused
        _, stderr = process.communicate(timeout=20)
        assert time.monotonic() - sent < 20
        for thread in threads:
            thread.join(30)
        _check_ended_cleanly(results, 8)
        _check_nothing_left(process, stderr)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_second_signal_skips_the_drain_tensor_parallel(tiny_model_dir):
    """--shutdown-timeout 600, yet a second SIGTERM aborts at once; the worker rank goes too."""
    process, url = _serve(tiny_model_dir, "--shutdown-timeout", "600", "--tensor-parallel-size", "2")
    try:
        assert len(descendants(process.pid)) >= 1
        results, started = {}, threading.Semaphore(0)
        threads = _load(url, results, 4, started)
        for _ in range(4):
            assert started.acquire(timeout=60)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
        assert time.monotonic() - sent < 20
        for thread in threads:
            thread.join(30)
        _check_ended_cleanly(results, 4)
        assert "error" in json.loads(results[0][1][-2].removeprefix("data: "))  # aborted, not finished
        _check_nothing_left(process, stderr)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_requests_that_finish_within_the_timeout_finish(tiny_model_dir):
    """Short requests in flight at SIGTERM complete normally, and the server exits once they have, not at the
    end of --shutdown-timeout."""
    process, url = _serve(tiny_model_dir, "--shutdown-timeout", "600")
    try:
        results, started = {}, threading.Semaphore(0)
        threads = _load(url, results, 4, started, max_tokens=64)
        for _ in range(4):
            assert started.acquire(timeout=60)
        deadline = time.monotonic() + 30
        while _requests_in_engine(url) < 5:  # the non-streaming one too, before the signal
            assert time.monotonic() < deadline, "the requests did not all reach the engine"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
        for thread in threads:
            thread.join(30)
        _check_ended_cleanly(results, 4)
        assert all("error" not in json.loads(results[i][1][-2].removeprefix("data: ")) for i in range(4))
        assert results["whole"][0] == 200
        _check_nothing_left(process, stderr)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
