"""Scale-out on the CPU (gloo, tiny models): tensor, pipeline and data parallel give the single-process engine's
greedy tokens (and so HF's) on a mixed-length batch; ranks hold their share of the parameters; a dead worker
stops the engine with a clear error at once and leaves no process behind, a dead replica leaves the other serving
(tests/test_data_parallel.py: the failover itself); the torchrun-style launch; the data-parallel router."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import PARITY_CONFIGS, build_hf_model, descendants, hf_greedy, processes, save_hf_model
from mini_infer import LLM, SamplingParams
from mini_infer.bench.options import parse_layout
from mini_infer.config import EngineConfig
from mini_infer.engine.data_parallel import DataParallelEngine
from mini_infer.distributed.processes import new_process, process_context
from mini_infer.distributed.shard import make_shard
from mini_infer.distributed.shm import SHM_DIR
from mini_infer.errors import InvalidRequestError, WorkerDiedError

PROMPT_LENGTHS = [1, 7, 33, 100, 5, 16]
MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)

_REFERENCES: dict[str, tuple] = {}


def _reference(name: str, tmp_path_factory) -> tuple:
    """(name, checkpoint, prompts, HF greedy of each prompt alone, the single-process engine's greedy and seeded
    runs), built once per model."""
    if name not in _REFERENCES:
        model = build_hf_model(seed=3, **PARITY_CONFIGS[name])
        path = save_hf_model(model, tmp_path_factory.mktemp(name))
        rng = random.Random(name)
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
        expected = [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]
        single = LLM(str(path), dtype="float64", block_size=4)
        greedy = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
        seeded = [o.outputs[0].token_ids for o in single.generate(prompts, SEEDED, use_tqdm=False)]
        _REFERENCES[name] = (name, path, prompts, expected, greedy, seeded)
    return _REFERENCES[name]


@pytest.fixture(scope="module", params=["untied-gqa", "tied-1kv", "untied-mha"])
def reference(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def untied_reference(tmp_path_factory):
    """The untied model: its head is not a second copy of the embedding on the last stage."""
    return _reference("untied-gqa", tmp_path_factory)


# Which layouts each model runs: tied-1kv has one KV head, so tp=2 replicates it; untied-mha has 3 layers, so
# its stages are uneven, and 6 KV heads split 3 per rank.
LAYOUTS = {
    "untied-gqa": ["tp2", "pp2", "dp2"],
    "tied-1kv": ["tp2", "pp2", "tp2pp2"],
    "untied-mha": ["tp2pp2", "pp3", "dp2tp2"],
}


@pytest.mark.parametrize("index", range(3))
def test_parallel_greedy_equals_single_process_and_hf(reference, index):
    name, path, prompts, expected, greedy, seeded = reference
    llm = LLM(str(path), dtype="float64", block_size=4, **parse_layout(LAYOUTS[name][index]))
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy == expected
        assert [o.request_id for o in outputs] == [str(i) for i in range(len(prompts))]
        # Rank 0 samples from the same logits, so seeded sampling draws the same tokens too.
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)] == seeded
        assert llm.engine.kv_cache_usage() == 0.0
    finally:
        llm.engine.shutdown()
    assert descendants(os.getpid()) == []


def test_tensor_parallel_replicates_kv_heads_it_cannot_split():
    """4 query heads over 1 KV head at tp=2 and tp=4: every rank keeps that KV head (parity above runs tp=2)."""
    config = _config(num_attention_heads=4, num_key_value_heads=1)
    for tp in (2, 4):
        shards = [make_shard(config, tp, rank) for rank in range(tp)]
        assert [(s.num_kv_heads, s.kv_head_start, s.num_heads, s.head_start) for s in shards] == \
            [(1, 0, 4 // tp, rank * 4 // tp) for rank in range(tp)]
    # 8 query heads over 2 KV heads at tp=4: ranks 0-1 share KV head 0, ranks 2-3 KV head 1.
    config = _config(num_attention_heads=8, num_key_value_heads=2)
    assert [make_shard(config, 4, rank).kv_head_start for rank in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("overrides, sizes, message", [
    (dict(num_attention_heads=6, num_key_value_heads=3), dict(tensor_parallel_size=2),
     "tensor_parallel_size=2 cannot split num_key_value_heads=3"),
    (dict(num_attention_heads=6, num_key_value_heads=6), dict(tensor_parallel_size=4),
     "tensor_parallel_size=4 must divide num_attention_heads=6"),
    (dict(num_hidden_layers=2), dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 exceeds num_hidden_layers=2"),
    (dict(), dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
])
def test_layouts_that_do_not_split_the_model_are_refused(tmp_path, overrides, sizes, message):
    settings = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    settings.update(overrides)
    path = save_hf_model(build_hf_model(**settings), tmp_path / "model")
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", **sizes)
    assert descendants(os.getpid()) == []


def test_tensor_and_pipeline_ranks_hold_half_the_parameters(untied_reference):
    # cpu_kernels on: every weight in one form (under auto, the forms a weight keeps follow its timings).
    _, path, *_ = untied_reference
    single = LLM(str(path), dtype="float32", cpu_kernels="on").engine.memory_stats()[0]["param_bytes"]
    for sizes in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        llm = LLM(str(path), dtype="float32", cpu_kernels="on", **sizes)
        try:
            stats = llm.engine.memory_stats()
        finally:
            llm.engine.shutdown()
        assert [s["rank"] for s in stats] == [0, 1]
        for s in stats:
            assert 0.45 * single <= s["param_bytes"] <= 0.55 * single, (sizes, s["param_bytes"], single)
            assert s["kv_bytes"] > 0 and s["peak_rss_bytes"] > s["param_bytes"]


def _kill_during_generate(llm: LLM, victim: int) -> float:
    """Kill `victim` one second into a long generate; seconds from the kill to WorkerDiedError. The victim is
    stopped (SIGSTOP) half a second before it is killed, so the others are surely waiting for it mid-step."""
    killed_at = []

    def kill() -> None:
        os.kill(victim, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        killed_at.append(time.monotonic())

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(WorkerDiedError) as error:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=900, ignore_eos=True), use_tqdm=False)
    timer.join()
    assert f"pid {victim}" in str(error.value) and "exited with code -9" in str(error.value)
    return time.monotonic() - killed_at[0]


def test_killed_worker_stops_the_engine_at_once_and_leaves_no_process(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", tensor_parallel_size=2)
    children = descendants(os.getpid())
    assert len(children) == 1  # rank 1 (the victim)
    seconds = _kill_during_generate(llm, children[-1])
    assert seconds < 10
    assert descendants(os.getpid()) == []
    with pytest.raises(WorkerDiedError, match="the engine has stopped"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("sizes, num_processes, max_tokens", [
    (dict(data_parallel_size=2), 2, 900),  # two replicas (the second is the victim)
    # two replicas and their rank 1s (one a victim); a pipeline's step is slower: ~400 tokens take what 900 take above
    (dict(data_parallel_size=2, pipeline_parallel_size=2), 4, 400),
])
def test_killed_replica_or_its_rank_leaves_the_other_serving_a_whole_batch(tiny_model_dir, monkeypatch, sizes,
                                                                           num_processes, max_tokens):
    """The victim's requests had returned nothing (LLM.generate's return when they finish): they are sent again to
    the other replica and the batch completes; without restarts the victim's processes are gone, then all are."""
    resent, settle = [], DataParallelEngine._settle

    def counted(self, index, process):
        before = len(self._waiting)
        settle(self, index, process)
        resent.append(len(self._waiting) - before)
    monkeypatch.setattr(DataParallelEngine, "_settle", counted)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_replica_restarts=0, **sizes)
    children = descendants(os.getpid())
    assert len(children) == num_processes
    victim = children[-1]
    timer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    timer.start()
    outputs = llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    timer.join()
    assert resent == [2]  # the kill landed mid-generation: both of the victim's requests were sent again
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outputs] == [("length", max_tokens)] * 4
    health = sorted(llm.engine.replica_health(), key=lambda h: h.state)
    assert [h.state for h in health] == ["gone", "live"] and "not restarted" in health[0].detail
    assert len(descendants(os.getpid())) == num_processes // 2
    llm.engine.shutdown()
    assert descendants(os.getpid()) == []


def _report_environment(results) -> None:
    with open("/proc/self/comm") as f:
        results.put((os.environ.get("MINI_INFER_TEST_MARK"), f.read().strip()))


def test_engine_processes_start_in_the_environment_of_the_moment_and_name_themselves(monkeypatch):
    """A process forked from the fork server gets its parent's environment as it is when the process starts (as a
    spawned one would), not the server's from when the server started; and its comm is the name it was given."""
    context = process_context()
    results = context.Queue()
    for mark in ["one", "two"]:  # the server runs by the second (started by the first, or an earlier test)
        monkeypatch.setenv("MINI_INFER_TEST_MARK", mark)
        process = new_process(context, _report_environment, (results,), name=f"mini-infer:{mark}")
        process.start()
        assert results.get(timeout=60) == (mark, f"mini-infer:{mark}")
        process.join(30)
        assert process.exitcode == 0


# A shell starts the program with Python's own SIGINT handler; a child of the test process inherits that process's
# disposition instead, and in full-suite runs it was SIG_IGN by then (the script then ignored the Ctrl-C, finished
# and exited 0), so the script puts the default back first.
CTRL_C_SCRIPT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from mini_infer import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", data_parallel_size=2, tensor_parallel_size=2)
print("ready", flush=True)
llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True),
             use_tqdm=False)
"""


def test_ctrl_c_stops_every_process(tiny_model_dir):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does) mid-generate: nothing survives."""
    process = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(tiny_model_dir)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        assert len(_group_members(process.pid)) >= 5  # the router, 2 replicas, 2 workers (+ resource tracker)
        os.killpg(process.pid, signal.SIGINT)
        # communicate() drains both pipes while it waits: a child blocked on a full stderr pipe cannot exit.
        _, stderr = process.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while _group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group_members(process.pid) == []
        assert process.returncode != 0 and "KeyboardInterrupt" in stderr, (process.returncode, stderr[-3000:])
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    return [pid for pid, state, _, group, _ in processes() if group == pgid and state != "Z"]


def test_torchrun_style_launch_runs_rank_1_as_mini_infer_worker(untied_reference, monkeypatch):
    """Two 'machines' on loopback: rank 1 is `mini-infer worker` started from the environment variables, rank 0
    this process with the same variables; same tokens as a single process."""
    _, path, prompts, expected, _, _ = untied_reference
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    worker = subprocess.Popen([sys.executable, "-m", "mini_infer.entrypoints.cli", "worker", "--model", str(path),
                               "--dtype", "float64", "--block-size", "4", "--tensor-parallel-size", "2"],
                              env={**os.environ, **env, "RANK": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        for key, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        llm = LLM(str(path), dtype="float64", block_size=4, tensor_parallel_size=2)
        try:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert worker.wait(timeout=30) == 0, worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()


def test_worker_command_refuses_rank_0_and_a_missing_environment(tiny_model_dir, monkeypatch):
    from mini_infer.entrypoints.cli import main

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert main(["worker", "--model", str(tiny_model_dir), "-tp", "2"]) == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert main(["worker", "--model", str(tiny_model_dir), "-tp", "2"]) == 2


def test_router_sends_each_request_to_the_least_loaded_replica(tiny_model_dir):
    engine = DataParallelEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", data_parallel_size=2))
    try:
        engine.add_request("long", [1] * 10, SamplingParams(max_tokens=300, ignore_eos=True))  # 310 tokens of work
        engine.add_request("short-a", [2] * 5, SamplingParams(max_tokens=20, ignore_eos=True))  # 25
        engine.add_request("short-b", [3] * 5, SamplingParams(max_tokens=20, ignore_eos=True))  # 25
        assert engine._owner == {"long": 0, "short-a": 1, "short-b": 1}
        assert engine.loads() == [310, 50]
        with pytest.raises(InvalidRequestError, match="prompt token id") as error:  # a bad one fails alone, here
            engine.add_request("bad", [10**9], SamplingParams(max_tokens=2))
        assert error.value.field == "prompt"
        with pytest.raises(InvalidRequestError, match="already in use"):
            engine.add_request("long", [1], SamplingParams(max_tokens=2))
        engine.abort_request("long")
        finished = {o.request_id: o.outputs[0] for o in engine.run_until_done() if o.finished}
        assert {rid: c.finish_reason for rid, c in finished.items()} == \
            {"long": "abort", "short-a": "length", "short-b": "length"}
        assert [len(finished[r].token_ids) for r in ("short-a", "short-b")] == [20, 20]
        stats = engine.stats()
        assert engine.loads() == [0, 0] and (stats.running, stats.waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    finally:
        engine.shutdown()
    assert descendants(os.getpid()) == []


def test_bench_parallel_reports_throughput_and_memory_per_rank(tiny_model_dir, tmp_path, capsys):
    from mini_infer.entrypoints.cli import main

    out = tmp_path / "par"
    assert main(["bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--parallel", "single,tp2,dp2",
                 "--parallel-batch-size", "4", "--parallel-new-tokens", "3", "--reps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    import json

    report = json.loads((out / "parallel.json").read_text())
    layouts = {lay["name"]: lay for lay in report["layouts"]}
    assert list(layouts) == ["single", "tp2", "dp2"] and layouts["single"]["vs_single"] == 1.0
    for name, lay in layouts.items():
        assert [run["output_tokens"] for run in lay["runs"]] == [4 * 3]
        assert len(lay["ranks"]) == lay["num_ranks"] == (1 if name == "single" else 2)
    tp = layouts["tp2"]["ranks"]
    assert all(r["kv_bytes"] * 2 == layouts["single"]["ranks"][0]["kv_bytes"] for r in tp)
    assert [r["replica"] for r in layouts["dp2"]["ranks"]] == [0, 1]
    assert "peak RSS MB" in printed and "dp1.r0" in printed and "r1" in printed
    assert (out / "parallel.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("text", ["tp", "tp2tp2", "ep2", "tp0"])
def test_bad_parallel_layouts_are_refused_by_name(text):
    with pytest.raises(ValueError, match="--parallel"):
        parse_layout(text)


def _config(**overrides):
    from mini_infer.config import ModelConfig

    raw = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
               rope_theta=10000.0)
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def test_server_over_data_parallel_replicas(tiny_model_dir):
    """`serve` builds its engine with create_engine: concurrent completions over 2 replicas equal offline
    generation; once a replica dies /health stays 200 and says so, and the other serves the same completions."""
    import asyncio

    import httpx

    from mini_infer.engine.data_parallel import create_engine
    from mini_infer.engine.async_engine import AsyncLLMEngine
    from mini_infer.engine.metrics import EngineMetrics
    from mini_infer.entrypoints.openai.api_server import build_app
    from test_server import ServerThread

    args = dict(dtype="float64", num_kv_blocks=256, max_num_seqs=16)
    texts = [f"river stone {i} " * (1 + i) for i in range(8)]
    offline = LLM(str(tiny_model_dir), **args)
    expected = [o.outputs[0].text for o in offline.generate(
        texts, SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.0), use_tqdm=False)]
    engine = AsyncLLMEngine(create_engine(EngineConfig(model=str(tiny_model_dir), data_parallel_size=2, **args)),
                            EngineMetrics("tiny"))
    try:
        with ServerThread(build_app(engine, "tiny")) as server:
            async def complete_all():
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    bodies = [dict(model="tiny", prompt=t, max_tokens=5, temperature=0, repetition_penalty=1.0)
                              for t in texts]
                    return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

            responses = asyncio.run(complete_all())
            assert [r.json()["choices"][0]["text"] for r in responses] == expected
            health = httpx.get(server.url + "/health")
            assert health.status_code == 200 and health.json()["live_replicas"] == 2
            os.kill(engine.engine.replicas[1].process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while (health := httpx.get(server.url + "/health")).json()["replicas"][1]["deaths"] == 0:
                assert time.monotonic() < deadline, health.json()
                time.sleep(0.05)
            assert health.status_code == 200 and health.json()["status"] in ("degraded", "ok")  # (ok: back already)
            assert "exited with signal SIGKILL" in health.json()["replicas"][1]["detail"]
            responses = asyncio.run(complete_all())
            assert [r.status_code for r in responses] == [200] * len(texts)
            assert [r.json()["choices"][0]["text"] for r in responses] == expected
    finally:
        engine.shutdown()
    assert descendants(os.getpid()) == []


def _shm_rank(rank: int, world: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from mini_infer.distributed.shm import ShmAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    reduce = ShmAllReduce(dist.group.WORLD, rank, world, leader=0)
    out = {}
    for dtype, numel in ((torch.float64, 7), (torch.bfloat16, 4099), (torch.float32, 3 * (1 << 20) // 2)):
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
        for _ in range(3):  # rounds reuse the two buffers
            out[(str(dtype), numel)] = reduce(x.clone())
    results.put((rank, {key: value.double().tolist() for key, value in out.items()}))  # plain data: exact
    dist.destroy_process_group()


def test_shared_memory_all_reduce_sums_in_rank_order_on_every_rank():
    """3 ranks (more than the cores here: the waiting path yields); float64, bfloat16 (summed in float32 and
    rounded once) and a float32 tensor of 6 MB, over the 4 MB slot: every rank gets the same, exact sum."""
    import torch
    import torch.multiprocessing as mp

    world = 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_shm_rank, args=(r, world, port, results)) for r in range(world)]
    for p in processes:
        p.start()
    outs = dict(results.get(timeout=120) for _ in range(world))
    for p in processes:
        p.join(30)
        assert p.exitcode == 0
    for (dtype_name, numel), got in outs[0].items():
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        got = torch.tensor(got, dtype=torch.float64).to(dtype)
        parts = [torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64).to(dtype)
                 for r in range(world)]
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        expected = (parts[0].to(accumulate) + parts[1].to(accumulate) + parts[2].to(accumulate)).to(dtype)
        assert torch.equal(got, expected), dtype_name
        assert all(outs[r][(dtype_name, numel)] == outs[0][(dtype_name, numel)] for r in range(1, world))
    assert not any(SHM_DIR.glob("mini-infer-tp-*"))


ORPHAN_SCRIPT = """
import os, sys, time
from mini_infer import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", **eval(sys.argv[2]))
print("ready", flush=True)
if sys.argv[3] == "busy":
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)
time.sleep(600)
"""


@pytest.mark.parametrize("sizes, state", [
    (dict(data_parallel_size=2, tensor_parallel_size=2), "idle"),  # replicas wait on their pipe, workers in gloo
    (dict(tensor_parallel_size=2), "busy"),  # rank 1 waits in the shared-memory all-reduce for rank 0
])
def test_processes_exit_when_the_engine_process_is_killed(tiny_model_dir, sizes, state):
    """SIGKILL to the engine's process (no cleanup runs there), idle or mid-step (stopped first, so that its
    peers are surely waiting for it): every other process exits by itself."""
    process = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_model_dir), repr(sizes), state],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        members = [pid for pid in _group_members(process.pid) if pid != process.pid]
        assert len(members) >= (4 if "data_parallel_size" in sizes else 1)  # (+ the resource tracker)
        time.sleep(1.0)
        os.kill(process.pid, signal.SIGSTOP)
        time.sleep(0.5)
        process.kill()
        process.wait(10)
        deadline = time.monotonic() + 30
        while _group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group_members(process.pid) == []
    finally:
        if _group_members(process.pid):
            os.killpg(process.pid, signal.SIGKILL)


def _shm_peer_exits(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from mini_infer.distributed.shm import ShmAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    reduce = ShmAllReduce(dist.group.WORLD, rank, 2, leader=0)
    reduce(torch.ones(4))
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed process is
    start = time.monotonic()
    try:
        reduce(torch.ones(4))  # waits for a rank that will never publish
        results.put("returned")
    except RuntimeError as e:
        results.put(f"{time.monotonic() - start:.1f} s: {e}")


def _two_shm_ranks(target) -> tuple[str, list]:
    """Run target(rank, port, results) in two spawned ranks; the first result one of them reports, and the
    processes (stopped ones are killed)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=target, args=(r, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return results.get(timeout=60), ranks
    finally:
        stopped = {pid for pid, state, *_ in processes() if state == "T"}
        for p in ranks:
            p.join(0 if p.pid in stopped else 3)  # the reporting rank returns at once; a stopped one never does
            if p.is_alive():
                p.kill()
                p.join(10)


def test_shared_memory_all_reduce_raises_when_a_peer_process_is_gone():
    """Without the watchdog this all-reduce would spin forever; with it, it raises within a second or so."""
    outcome, processes = _two_shm_ranks(_shm_peer_exits)
    seconds, message = outcome.split(" s: ")
    assert float(seconds) < 5 and "tensor-parallel peer" in message and f"pid {processes[1].pid}" in message


def _shm_peer_stops(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from mini_infer.distributed.shm import ShmAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    reduce = ShmAllReduce(dist.group.WORLD, rank, 2, leader=0, timeout_s=1.0)
    reduce(torch.ones(4))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, but never answers again
    start = time.monotonic()
    try:
        reduce(torch.ones(4))
        results.put("returned")
    except RuntimeError as e:
        results.put(f"{time.monotonic() - start:.1f} s: {e}")


def test_shared_memory_all_reduce_times_out_on_a_stopped_peer():
    """A peer that is alive but stopped (SIGSTOP) would keep the watchdog's liveness check happy forever: the
    wait times out instead, like the gloo path's collectives."""
    outcome, _ = _two_shm_ranks(_shm_peer_stops)
    seconds, message = outcome.split(" s: ")
    assert 1.0 <= float(seconds) < 10 and "did not answer within 1 s" in message


def test_shared_memory_all_reduce_refuses_more_ranks_than_its_table():
    from mini_infer.distributed.shm import MAX_RANKS, ShmAllReduce

    with pytest.raises(ValueError, match=f"at most {MAX_RANKS} ranks"):
        ShmAllReduce(None, 0, MAX_RANKS + 1, leader=0)
