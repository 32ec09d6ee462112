"""Data-parallel failover, measured: `mini-infer serve -dp 2` under 16 concurrent streams while replica 1 is SIGKILLed
five times in a row (each time once it is back; after the restart bound there is nothing left to kill).

For each kill: the streams in flight at the kill, how many ended with an error event and how long after the kill
the slowest one came, how many finished normally (on the survivor, or sent again when nothing of them had been
sent), and how long until /health shows the replica live again and its process computes (its CPU time grows while
it serves). Over the run: every response's status (a 5xx, or an error event, on a request that was in flight at no
kill is a failure), the /health answers, the replica counters of /metrics, and whether any process outlives the
server. Writes results.json and results.md to --out.

    .venv/bin/python scripts/dp_failover.py [--model DIR] [--out docs/benchmarks/dp-failover]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

STREAMS = 16
KILLS = 5
MAX_RESTARTS = 3
HEALTH_EVERY_S = 0.1


@dataclass(slots=True)
class Request:
    started: float
    ended: float | None = None
    first_token: float | None = None
    status: int | None = None
    outcome: str = "open"  # ok, error_event, http_error, exception
    message: str | None = None


@dataclass(slots=True)
class Kill:
    attempt: int
    pid: int | None  # None: no replica 1 process to kill (its restarts are spent)
    at: float
    in_flight: int = 0
    error_events: int = 0
    slowest_error_event_s: float | None = None
    finished_normally: int = 0
    without_token_at_kill: int = 0  # finished normally, but had no token out at the kill: sent again or queued
    back_live_s: float | None = None
    serving_s: float | None = None
    health_after: str | None = None


@dataclass(slots=True)
class Run:
    url: str
    stop: threading.Event = field(default_factory=threading.Event)
    requests: list[Request] = field(default_factory=list)
    health: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream_forever(run: Run, index: int, max_tokens: int) -> None:
    """One of the concurrent clients: streamed completions back to back until told to stop."""
    body = {"model": "tiny", "prompt": f"stream {index}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=run.url, timeout=120) as http:
        while not run.stop.is_set():
            request = Request(time.monotonic())
            with run.lock:
                run.requests.append(request)
            try:
                stream_one(http, body, request)
            except httpx.HTTPError as e:
                request.outcome, request.message = "exception", repr(e)
            request.ended = time.monotonic()


def stream_one(http: httpx.Client, body: dict, request: Request) -> None:
    with http.stream("POST", "/v1/completions", json=body) as response:
        request.status = response.status_code
        if response.status_code != 200:
            response.read()
            request.outcome, request.message = "http_error", response.text[:300]
            return
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                request.ended = time.monotonic()
                request.outcome, request.message = "error_event", event["error"]["message"]
                return
            if request.first_token is None:
                request.first_token = time.monotonic()
        request.outcome = "ok"


def watch_health(run: Run) -> None:
    with httpx.Client(base_url=run.url, timeout=10) as http:
        while not run.stop.is_set():
            try:
                response = http.get("/health")
                body = response.json()
                run.health.append({"t": time.monotonic(), "status": response.status_code,
                                   "live": body.get("live_replicas"), "replicas": body.get("replicas"),
                                   "error": (body.get("error") or {}).get("message")})
            except (httpx.HTTPError, ValueError) as e:
                run.health.append({"t": time.monotonic(), "status": None, "error": repr(e)})
            time.sleep(HEALTH_EVERY_S)


def replica(run: Run, index: int) -> dict:
    return httpx.get(run.url + "/health", timeout=10).json()["replicas"][index]


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_back(run: Run, kill: Kill, timeout: float = 60.0) -> dict:
    """Wait until replica 1 is live again (another process) or gone; then until its process computes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = replica(run, 1)
        if state["state"] == "gone" or (state["state"] == "live" and state["pid"] != kill.pid):
            break
        time.sleep(0.05)
    kill.health_after = state["detail"]
    if state["state"] != "live":
        return state
    kill.back_live_s = time.monotonic() - kill.at
    ticks = cpu_ticks(state["pid"])
    while time.monotonic() < deadline and cpu_ticks(state["pid"]) - ticks < 5:  # 50 ms of CPU: it steps requests
        time.sleep(0.05)
    kill.serving_s = time.monotonic() - kill.at if cpu_ticks(state["pid"]) - ticks >= 5 else None
    return state


def settle(run: Run, kill: Kill) -> None:
    """What became of the streams in flight at the kill (call once they have ended)."""
    hit = [r for r in run.requests if r.started < kill.at and (r.ended is None or r.ended > kill.at)]
    kill.in_flight = len(hit)
    errors = [r.ended - kill.at for r in hit if r.outcome == "error_event"]
    kill.error_events = len(errors)
    kill.slowest_error_event_s = round(max(errors), 3) if errors else None
    normal = [r for r in hit if r.outcome == "ok"]
    kill.finished_normally = len(normal)
    kill.without_token_at_kill = sum(r.first_token is None or r.first_token > kill.at for r in normal)


def kill_in_turn(run: Run, attempt: int) -> Kill:
    state = replica(run, 1)
    pid = state["pid"] if state["state"] == "live" else None
    kill = Kill(attempt, pid, time.monotonic())
    if pid is None:
        kill.health_after = state["detail"]
        return kill
    os.kill(pid, signal.SIGKILL)
    wait_back(run, kill)
    return kill


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, dtype: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "mini_infer.entrypoints.cli", "serve", "--model", model, "--dtype", dtype,
               "--port", str(port), "--served-model-name", "tiny", "-dp", "2",
               "--max-replica-restarts", str(MAX_RESTARTS), "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not come up in 300 s")


def session_members(session: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                members.append(int(entry))
    return members


def stop_server(server: subprocess.Popen) -> list[int]:
    """SIGTERM, then the processes of its session still there 15 s later (none expected)."""
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    deadline = time.monotonic() + 15
    while session_members(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session_members(server.pid)
    if left:
        os.killpg(server.pid, signal.SIGKILL)
    return left


def exercise(run: Run, max_tokens: int) -> list[Kill]:
    clients = [threading.Thread(target=stream_forever, args=(run, i, max_tokens), daemon=True) for i in range(STREAMS)]
    watcher = threading.Thread(target=watch_health, args=(run,), daemon=True)
    for thread in [*clients, watcher]:
        thread.start()
    while sum(r.first_token is not None for r in list(run.requests)) < STREAMS:  # all 16 streaming
        time.sleep(0.05)
    kills = [kill_in_turn(run, attempt) for attempt in range(1, KILLS + 1)]
    time.sleep(3.0)  # the survivor (and a last restart) under load a while longer
    run.stop.set()
    for thread in [*clients, watcher]:
        thread.join(120)
    for kill in kills:
        if kill.pid is not None:
            settle(run, kill)
    return kills


def violations(run: Run, kills: list[Kill]) -> dict:
    """Requests in flight at no kill that got a 5xx or an error event (the acceptance wants none)."""
    times = [k.at for k in kills if k.pid is not None]

    def hit(r: Request) -> bool:
        return any(r.started < t and (r.ended is None or r.ended > t) for t in times)

    spared = [r for r in run.requests if not hit(r)]
    return {"requests": len(run.requests), "in_flight_at_no_kill": len(spared),
            "5xx_on_those": sum(r.status is not None and r.status >= 500 for r in spared),
            "error_events_on_those": sum(r.outcome == "error_event" for r in spared),
            "exceptions_on_those": sum(r.outcome == "exception" for r in spared),
            "5xx_status_any_request": sum(r.status is not None and r.status >= 500 for r in run.requests),
            "examples": [r.message for r in spared if r.outcome != "ok"][:3]}


def metrics_lines(url: str) -> list[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith("mini_infer:dp_")]


def health_summary(run: Run, start: float) -> list[dict]:
    """The /health answers where they changed: time, status, live replicas, replica 1's state."""
    changes, last = [], None
    for h in run.health:
        key = (h["status"], h.get("live"), (h.get("replicas") or [{}, {}])[1].get("state"))
        if key != last:
            changes.append({"t_s": round(h["t"] - start, 2), "status": h["status"], "live": key[1],
                            "replica_1": key[2]})
            last = key
    return changes


def markdown(result: dict) -> str:
    rows = ["| kill | pid | streams in flight | error events | slowest error event (s) | finished normally "
            "(no token at kill) | live again after (s) | computing after (s) | replica 1 after |",
            "|---|---|---|---|---|---|---|---|---|"]
    for k in result["kills"]:
        if k["pid"] is None:
            rows.append(f"| {k['attempt']} | none | - | - | - | - | - | - | {k['health_after']} |")
            continue
        rows.append(f"| {k['attempt']} | {k['pid']} | {k['in_flight']} | {k['error_events']} | "
                    f"{k['slowest_error_event_s']} | {k['finished_normally']} ({k['without_token_at_kill']}) | "
                    f"{_fmt(k['back_live_s'])} | {_fmt(k['serving_s'])} | {k['health_after']} |")
    v, final = result["violations"], result["final_health"]
    return "\n".join([
        f"# Data-parallel failover ({result['command']})", "",
        f"{result['machine']}; {result['model']}; {STREAMS} concurrent streams of {result['max_tokens']} tokens; "
        f"--max-replica-restarts {MAX_RESTARTS}; {result['seconds']:.0f} s.", "", *rows, "",
        "| over the run | |", "|---|---|",
        f"| requests | {v['requests']} ({v['in_flight_at_no_kill']} in flight at no kill) |",
        f"| 5xx / error events / exceptions on those | {v['5xx_on_those']} / {v['error_events_on_those']} / "
        f"{v['exceptions_on_those']} |",
        f"| HTTP 5xx statuses, any request | {v['5xx_status_any_request']} |",
        f"| /health polls (every {HEALTH_EVERY_S} s) / 503s among them | {result['health_polls']} / "
        f"{result['health_503']} |",
        f"| final /health | {final['status']}: {final['live_replicas']}/{final['total_replicas']} live; replica 1: "
        f"{final['replicas'][1]['detail']} |",
        f"| /metrics | {'; '.join(result['metrics'])} |",
        f"| processes left after SIGTERM | {len(result['processes_left'])} |", ""])


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the tiny preset, written to a "
                                                      "temporary directory)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default="docs/benchmarks/dp-failover")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from mini_infer.factory import make_model

            model = str(make_model("tiny", Path(tmp) / "tiny", seed=0, dtype="float32"))
        started = time.monotonic()
        server, url = start_server(model, args.dtype)
        try:
            run = Run(url)
            kills = exercise(run, args.max_tokens)
            final = httpx.get(url + "/health", timeout=10)
            result = {"command": "scripts/dp_failover.py", "machine": machine(), "model": args.model or "tiny preset",
                      "max_tokens": args.max_tokens, "kills": [asdict(k) for k in kills],
                      "violations": violations(run, kills), "final_health_status": final.status_code,
                      "final_health": final.json(), "metrics": metrics_lines(url),
                      "health_polls": len(run.health),
                      "health_503": sum(h["status"] == 503 for h in run.health),
                      "health_changes": health_summary(run, started)}
        finally:
            left = stop_server(server)
        result["processes_left"] = left
        result["seconds"] = time.monotonic() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def machine() -> str:
    from mini_infer.machine import cpu, usable_cores

    return f"{cpu().model}, {usable_cores()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
