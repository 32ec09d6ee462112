"""The systems under test behind one interface: run(prompts, output_lens) -> RunResult, then close().

Each request generates exactly its output length with plain greedy decoding and EOS ignored; outputs are
counted the same way for every system, from the generated token ids.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

SYSTEM_NAMES = ("hf-generate", "hf-continuous", "mini-infer")
# Run where the installed transformers supports them; otherwise skipped with the reason.
OPTIONAL_SYSTEMS = ("hf-continuous",)


def count_output_tokens(token_ids: Sequence[Sequence[int]]) -> int:
    """Generated tokens over all requests: the number of generated ids each request returned."""
    return sum(len(ids) for ids in token_ids)


@dataclass(slots=True)
class RunResult:
    token_ids: list[list[int]]  # each request's generated ids, in submission order
    finish_s: list[float]  # each request's finish time, in seconds after the run started
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return count_output_tokens(self.token_ids)


class MiniInferSystem:
    """mini-infer's LLM, its engine stepped directly (LLM.generate's loop, without the progress bar) so that
    each request's finish time is seen."""

    name = "mini-infer"

    def __init__(self, model_dir: str, engine_args: dict) -> None:
        from mini_infer import LLM

        self.llm = LLM(model_dir, **engine_args)
        self._request_ids = itertools.count()

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        from mini_infer import RequestOutputKind, SamplingParams

        engine = self.llm.engine
        start = time.perf_counter()
        index = {}
        for prompt, output_len in zip(prompts, output_lens):
            request_id = f"bench-{next(self._request_ids)}"
            index[request_id] = len(index)
            # Explicit params: the checkpoint's defaults (e.g. repetition_penalty 1.1) are not plain greedy.
            engine.add_request(request_id, prompt, SamplingParams(
                temperature=0.0, repetition_penalty=1.0, max_tokens=output_len, ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY))
        token_ids, finish_s = [[] for _ in prompts], [0.0] * len(prompts)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    token_ids[index[output.request_id]] = output.outputs[0].token_ids
                    finish_s[index[output.request_id]] = time.perf_counter() - start
        return RunResult(token_ids, finish_s, time.perf_counter() - start)

    def close(self) -> None:
        self.llm.engine.shutdown()
        del self.llm


class SystemFactory:
    """Builds the named systems; the HF ones share one transformers model, loaded on first use."""

    def __init__(self, model_dir: str, dtype: str, *, max_requests: int, max_seq_len: int,
                 static_batch_size: int | None = None) -> None:
        self.model_dir, self.dtype = model_dir, dtype
        self.max_requests, self.max_seq_len = max_requests, max_seq_len
        self.static_batch_size = static_batch_size
        self._hf_model = None

    def build(self, name: str):
        if name == "mini-infer":
            # Prefix caching off: the timed runs repeat the warm-up's prompts, and reusing their K/V would skip
            # prefill work that the HF systems must do (the shared-prefix workload measures the cache itself).
            return MiniInferSystem(self.model_dir, dict(dtype=self.dtype, max_num_seqs=max(256, self.max_requests),
                                                        enable_prefix_caching=False))
        from mini_infer.bench import hf

        if self._hf_model is None:
            self._hf_model = hf.load_model(self.model_dir, self.dtype)
        if name == "hf-generate":
            return hf.HFGenerate(self._hf_model, self.static_batch_size)
        if name == "hf-continuous":
            return hf.HFContinuous(self._hf_model, self.max_requests, self.max_seq_len)
        raise ValueError(f"system must be one of {', '.join(SYSTEM_NAMES)}, got {name!r}")


@dataclass(slots=True)
class Case:
    """One measured setting (a batch size, or the random workload), with a shorter warm-up run before it."""

    label: str
    prompts: list[list[int]]
    output_lens: list[int]
    warmup_prompts: list[list[int]]
    warmup_output_lens: list[int]


@dataclass(slots=True)
class SystemRecord:
    runs: dict[str, list[RunResult]] = field(default_factory=dict)  # case label -> timed runs
    reason: str | None = None  # why the system was skipped; None when it ran


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def run_systems(factory: SystemFactory, names: list[str], cases: list[Case], reps: int,
                log: Callable[[str], None]) -> dict[str, SystemRecord]:
    """Each system in turn: for each case a warm-up run, then `reps` timed runs. An optional system that
    fails is recorded with a one-line reason; any other failure propagates."""
    records = {}
    for name in names:
        log(f"{name}: loading")
        try:
            system = factory.build(name)
            try:
                records[name] = SystemRecord(runs=_measure(name, system, cases, reps, log))
            finally:
                system.close()
        except Exception as error:
            if name not in OPTIONAL_SYSTEMS:
                raise
            records[name] = SystemRecord(reason=one_line(error))
            log(f"{name} skipped: {records[name].reason}")
    return records


def _measure(name: str, system, cases: list[Case], reps: int, log: Callable[[str], None]) -> dict:
    runs = {}
    for case in cases:
        log(f"{name} {case.label} warm-up")
        system.run(case.warmup_prompts, case.warmup_output_lens)
        runs[case.label] = []
        for rep in range(reps):
            result = system.run(case.prompts, case.output_lens)
            runs[case.label].append(result)
            log(f"{name} {case.label} rep {rep + 1}/{reps}: {result.wall_s:.2f} s, "
                f"{result.output_tokens / result.wall_s:.1f} output tok/s")
    return runs
