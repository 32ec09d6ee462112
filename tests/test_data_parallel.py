"""Data-parallel failover (engine/data_parallel.py): a SIGKILLed replica leaves the router while the other serves;
its requests are sent again when nothing of them was returned, else fail alone with the reason; it is restarted
in the background up to max_replica_restarts and takes requests again; /health and /metrics count it all; no
process outlives the engine, a restarting replica's included."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client import generate_latest

from conftest import descendants
from mini_infer import SamplingParams
from mini_infer.config import EngineConfig
from mini_infer.engine.arg_utils import EngineArgs
from mini_infer.engine.async_engine import AsyncLLMEngine
from mini_infer.engine.data_parallel import DataParallelEngine
from mini_infer.engine.metrics import EngineMetrics
from mini_infer.entrypoints.openai.api_server import build_app
from mini_infer.errors import WorkerDiedError
from mini_infer.sampling_params import RequestOutputKind
from test_server import ServerThread

STREAMED = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
QUIET = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def _engine(model_dir, restarts: int, backoff_s: float = 0.05) -> DataParallelEngine:
    # torch's kernels: nothing here depends on which, and a fresh test cache would time the native ones first.
    return DataParallelEngine(EngineConfig(model=str(model_dir), dtype="float32", cpu_kernels="off",
                                           data_parallel_size=2, max_replica_restarts=restarts),
                              restart_backoff_s=backoff_s)


def _until(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def _states(engine: DataParallelEngine) -> list[str]:
    return [h.state for h in engine.replica_health()]


def _kill(engine: DataParallelEngine, index: int) -> int:
    pid = engine.replicas[index].process.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def _finish(engine: DataParallelEngine) -> dict[str, tuple]:
    """Step until every request finished: {request id: (finish reason, stop reason, tokens)}."""
    return {o.request_id: (o.outputs[0].finish_reason, o.outputs[0].stop_reason, len(o.outputs[0].token_ids))
            for o in engine.run_until_done() if o.finished}


def _metric(metrics: EngineMetrics, line_start: str) -> float:
    text = generate_latest(metrics.registry).decode()
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).rsplit(" ", 1)[1])


def test_max_replica_restarts_is_checked_and_has_a_flag(tiny_model_dir):
    with pytest.raises(ValueError, match="max_replica_restarts must be an integer >= 0, got -1"):
        EngineConfig(model=str(tiny_model_dir), max_replica_restarts=-1)
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).max_replica_restarts == 3
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_model_dir), "--max-replica-restarts", "0"]))
    assert args.create_engine_config().max_replica_restarts == 0


def test_dead_replica_leaves_the_router_its_requests_go_on_or_fail_alone_and_it_returns_to_the_bound(tiny_model_dir):
    engine = _engine(tiny_model_dir, restarts=1)
    metrics = EngineMetrics("tiny")
    metrics.watch_replicas(engine.replica_health)
    try:
        for name, params in (("streamed-0", STREAMED), ("streamed-1", STREAMED), ("quiet-0", QUIET),
                             ("quiet-1", QUIET)):
            engine.add_request(name, [1, 2, 3], params)
        assert engine._owner == {"streamed-0": 0, "streamed-1": 1, "quiet-0": 0, "quiet-1": 1}
        returned: set[str] = set()
        while not {"streamed-0", "streamed-1"} <= returned:
            returned |= {o.request_id for o in engine.step()}
        victim = _kill(engine, 1)
        _until(lambda: engine.replica_health()[1].deaths == 1)
        engine.add_request("while-dead", [4, 5], SHORT)  # the router has only replica 0 until 1 is back
        assert engine._owner["while-dead"] == 0 and _states(engine)[1] in ("backoff", "starting")
        ended = _finish(engine)
        # streamed-1 had returned tokens: it fails alone, saying why; quiet-1 had not: it ran again on replica 0.
        assert ended.pop("streamed-1") == ("error", f"replica 1 (pid {victim}) exited with signal SIGKILL while the "
                                                    "request ran", 0)
        assert ended.pop("streamed-0")[0] == "length"
        assert ended == {"quiet-0": ("length", None, 400), "quiet-1": ("length", None, 400),
                         "while-dead": ("length", None, 4)}

        _until(lambda: _states(engine) == ["live", "live"])  # restarted in the background, then routed to again
        engine.add_request("back-a", [6], SHORT)
        engine.add_request("back-b", [7], SHORT)
        assert engine._owner == {"back-a": 0, "back-b": 1}
        assert _finish(engine) == {"back-a": ("length", None, 4), "back-b": ("length", None, 4)}
        assert engine.replica_health()[1].restarts == 1
        assert _metric(metrics, 'mini_infer:dp_replica_restarts_total{model_name="tiny",replica="1"}') == 1

        _kill(engine, 1)  # the bound (1 restart) is spent: it stays gone, replica 0 serves on
        _until(lambda: _states(engine)[1] == "gone")
        detail = engine.replica_health()[1].detail
        assert "exited with signal SIGKILL; not restarted: 1 restarts already (the bound)" in detail
        engine.check_health()
        engine.add_request("alone", [8], SHORT)
        assert _finish(engine) == {"alone": ("length", None, 4)}
        assert _metric(metrics, 'mini_infer:dp_replica_deaths_total{model_name="tiny",replica="1"}') == 2
        assert _metric(metrics, 'mini_infer:dp_replica_deaths_total{model_name="tiny",replica="0"}') == 0
        assert _metric(metrics, 'mini_infer:dp_replicas_live{model_name="tiny"}') == 1
    finally:
        engine.shutdown()
    assert descendants(os.getpid()) == []


def test_requests_wait_while_no_replica_is_live_and_shutdown_mid_restart_leaves_no_process(tiny_model_dir):
    engine = _engine(tiny_model_dir, restarts=2, backoff_s=0.3)
    try:
        _kill(engine, 0)
        _kill(engine, 1)
        _until(lambda: [h.deaths for h in engine.replica_health()] == [1, 1])
        engine.add_request("waits", [1, 2, 3], SHORT)
        assert "waits" not in engine._owner and engine.has_unfinished_requests()
        engine.check_health()  # restarts are coming: not dead
        assert _finish(engine) == {"waits": ("length", None, 4)}  # step() waited for a replica to come back

        _kill(engine, 1)
        _until(lambda: _states(engine)[1] == "starting")  # its second restart loads now
    finally:
        engine.shutdown()
    assert descendants(os.getpid()) == []


def _stream(url: str, results: list, started: threading.Semaphore) -> None:
    """One long streamed completion: its data lines, each with the time it came."""
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = []
        for line in response.iter_lines():
            if line:
                lines.append((time.monotonic(), line))
                if len(lines) == 1:
                    started.release()
    results.append(lines)


def test_server_ends_the_dead_replicas_streams_with_an_error_event_and_serves_on(tiny_model_dir):
    engine = AsyncLLMEngine(_engine(tiny_model_dir, restarts=0), EngineMetrics("tiny"))
    try:
        with ServerThread(build_app(engine, "tiny")) as server:
            results: list = []
            started = threading.Semaphore(0)
            threads = [threading.Thread(target=_stream, args=(server.url, results, started)) for _ in range(4)]
            for thread in threads:
                thread.start()
            for _ in threads:
                assert started.acquire(timeout=30)
            _kill(engine.engine, 1)
            killed_at = time.monotonic()
            during = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            for thread in threads:
                thread.join(60)

            assert during.status_code == 200
            failed = [lines for lines in results if lines[-2][1].startswith('data: {"error"')]
            assert len(failed) == 2 and all(lines[-1][1] == "data: [DONE]" for lines in results)
            for lines in failed:
                error = json.loads(lines[-2][1][len("data: "):])["error"]
                assert error["code"] == 503 and "exited with signal SIGKILL while the request ran" in error["message"]
                assert lines[-2][0] - killed_at < 1.0
            finished = [json.loads(lines[-2][1][len("data: "):]) for lines in results if lines not in failed]
            assert [f["choices"][0]["finish_reason"] for f in finished] == ["length", "length"]

            health = httpx.get(server.url + "/health")
            assert health.status_code == 200
            assert {k: health.json()[k] for k in ("status", "live_replicas", "total_replicas")} == \
                {"status": "degraded", "live_replicas": 1, "total_replicas": 2}
            assert health.json()["replicas"][1]["state"] == "gone"
            text = httpx.get(server.url + "/metrics").text
            assert 'mini_infer:dp_replica_deaths_total{model_name="tiny",replica="1"} 1.0' in text
            assert 'mini_infer:dp_replicas_live{model_name="tiny"} 1.0' in text
            assert 'mini_infer:request_success_total{finished_reason="error",model_name="tiny"} 2.0' in text

            _kill(engine.engine, 0)
            health = _until(lambda: (r := httpx.get(server.url + "/health")).status_code == 503 and r)
            assert health.json()["live_replicas"] == 0
            message = health.json()["error"]["message"]
            assert message.startswith("no data-parallel replica is live: replica 0 (pid ")
            assert "not restarted: 0 restarts already (the bound)" in message
            refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 500 and "no data-parallel replica is left" in refused.text
            with pytest.raises(WorkerDiedError, match="no data-parallel replica is left"):
                engine.engine.check_health()
    finally:
        engine.shutdown()
    assert descendants(os.getpid()) == []
