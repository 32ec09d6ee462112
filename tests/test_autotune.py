"""The matmul autotuner: its choice per shape and bucket, its cache and what invalidates it, and a model whose
linear layers switch between the native matmul and torch's by batch size."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mini_infer import machine
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.kernels import autotune, cpu
from mini_infer.kernels.autotune import BUCKETS, LinearTuner, bucket_index, machine_key
from mini_infer.model import ops as ops_module
from mini_infer.model.ops import TunedWeight
from conftest import PARITY_CONFIGS, build_hf_model, save_hf_model
from test_parity import engine_logits

needs_kernels = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                   reason="the native kernels need AVX2 + FMA")


def split_timer(calls: list):
    """AVX2 fastest below 8 rows, torch from 8 on, the AVX-512 paths never."""
    def timer(candidate, rows, out_features, in_features):
        calls.append((candidate, rows, out_features, in_features))
        assert candidate in autotune.CANDIDATES
        return {"avx2": 1.0 if rows < 8 else 3.0, "torch": 2.0}.get(candidate, 2.5)
    return timer


def test_the_cpu_identity_names_the_model_and_its_instruction_sets():
    identity = autotune.cpu_identity()
    assert identity.endswith("]") and ("avx2" in identity) == (torch.backends.cpu.get_cpu_capability() != "DEFAULT")


def test_buckets_cover_every_row_count():
    assert [bucket_index(r) for r in (1, 2, 3, 8, 9, 64, 65, 512, 10_000)] == [0, 1, 2, 3, 4, 6, 7, 9, 9]


def test_the_tuner_keeps_the_faster_candidate_per_bucket_and_caches_it(tmp_path):
    calls = []
    path = tmp_path / "linear.json"
    tuner = LinearTuner("k", split_timer(calls), ("avx2", "avx512", "torch"), path)
    winners = tuner.winners(48, 32)
    assert winners == tuple("avx2" if size < 8 else "torch" for size in BUCKETS)
    timed = 3 * (1 + autotune._ROUNDS) * len(BUCKETS)  # a warm-up and the rounds, per candidate and bucket
    assert len(calls) == timed and {c[2:] for c in calls} == {(48, 32)}
    assert tuner.choices() == {"48x32": list(winners)}
    again = LinearTuner("k", split_timer(calls), ("avx2", "avx512", "torch"), path)
    assert again.winners(48, 32) == winners  # from the file: no timing
    assert len(calls) == timed
    assert json.loads(path.read_text()) == {"48x32": list(winners)}


def test_candidates_are_timed_in_turn_so_that_drift_falls_on_all_alike(tmp_path):
    """A machine slowing down call by call: avx2 is 10 % faster than torch at any moment, but timed all of one
    and then all of the other it would lose to torch's early calls."""
    calls = []

    def drifting(candidate, rows, out_features, in_features):
        calls.append(candidate)
        return (1.0 if candidate == "avx2" else 1.1) * (1 + 0.2 * len(calls))

    tuner = LinearTuner("k", drifting, ("torch", "avx2"), tmp_path / "linear.json")
    assert tuner.winners(48, 32) == ("avx2",) * len(BUCKETS)
    assert calls[:2 * (1 + autotune._ROUNDS)] == ["torch", "avx2"] * (1 + autotune._ROUNDS)


def test_the_choices_read_as_runs_of_bucket_sizes():
    choices = {"40x24": ["avx2", "avx2", "avx512", "avx512", "avx512", "avx512", "avx512", "torch", "torch", "avx512"]}
    assert autotune.describe_choices(choices) == ["40x24: avx2 at 1-2, avx512 at 4-64, torch at 128-256, avx512 at 512"]


def test_a_cache_naming_a_path_this_machine_cannot_run_is_timed_again(tmp_path):
    """A table written where AVX-512 ran, read where only AVX2 and torch's run (same key: a shared cache dir)."""
    path = tmp_path / "linear.json"
    path.write_text(json.dumps({"48x32": ["avx512"] * len(BUCKETS)}))
    calls = []
    assert LinearTuner("k", split_timer(calls), ("avx2", "torch"), path).winners(48, 32)[0] == "avx2"
    assert {c[0] for c in calls} == {"avx2", "torch"}


def test_a_damaged_cache_is_timed_again(tmp_path):
    path = tmp_path / "linear.json"
    path.write_text('{"48x32": ["avx2"]}')  # the wrong number of buckets
    calls = []
    LinearTuner("k", split_timer(calls), ("avx2", "torch"), path).winners(48, 32)
    assert calls


def test_the_key_changes_with_what_decides_the_timings(monkeypatch):
    base = machine_key(torch.bfloat16, "kernel v1")
    assert machine_key(torch.float32, "kernel v1") != base
    assert machine_key(torch.bfloat16, "kernel v2") != base
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert machine_key(torch.bfloat16, "kernel v1") != base
    monkeypatch.undo()
    monkeypatch.setattr(autotune, "cpu_identity", lambda: "another CPU [avx2]")
    assert machine_key(torch.bfloat16, "kernel v1") != base
    monkeypatch.undo()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert machine_key(torch.bfloat16, "kernel v1") != base
    finally:
        torch.set_num_threads(threads)
    assert machine_key(torch.bfloat16, "kernel v1") == base


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_timer_times_every_candidate_this_cpu_runs(dtype):
    timer = ops_module._LinearTimer(dtype)
    runnable = [path for path, why in cpu.matmul_paths(dtype).items() if why is None]
    assert "avx2" in runnable
    assert all(timer(candidate, 4, 40, 24) > 0 for candidate in (*runnable, "torch"))


@needs_kernels
@pytest.mark.parametrize("winners, layouts, dense", [(("avx2",) * len(BUCKETS), {"panels"}, False),
                                                    (("torch",) * len(BUCKETS), set(), True),
                                                    (("avx512_bf16", "avx512") * 5, {"pairs"}, False),
                                                    (("avx2", "avx512") * 5, {"panels", "pairs"}, False),
                                                    (("avx512_bf16",) * 9 + ("torch",), {"pairs"}, True)])
def test_a_weight_keeps_only_the_forms_its_winners_need(winners, layouts, dense):
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(40, 24).to(torch.bfloat16))
    tuned = ops_module.Ops(True, "test", _FixedTuner(winners))
    tuned.prepare([(module, "weight")])
    assert isinstance(module.weight, TunedWeight)
    assert set(module.weight.packed) == layouts and (module.weight.dense is not None) == dense


@needs_kernels
@pytest.mark.parametrize("available, kept", [(10**12, True), (3 * 40 * 24, False)])
def test_torchs_second_copy_is_kept_only_where_memory_allows(monkeypatch, available, kept):
    """The 40 x 24 bf16 weight's dense copy is 1920 bytes: kept beside 1 TB available, not beside 2880 bytes (more
    than half), where torch's bucket runs its neighbour's native path and a warning says so."""
    monkeypatch.setattr(ops_module.machine, "available_memory", lambda: available)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(40, 24).to(torch.bfloat16))
    winners = ("avx512_bf16",) * 9 + ("torch",)
    tuned = ops_module.Ops(True, "test", _FixedTuner(winners))
    if kept:
        tuned.prepare([(module, "weight")])
    else:
        with pytest.warns(UserWarning, match="nearest native winner"):
            tuned.prepare([(module, "weight")])
    assert (module.weight.dense is not None) == kept
    assert module.weight.winners == (winners if kept else ("avx512_bf16",) * 10)


def test_native_only_gives_torchs_buckets_the_nearest_native_winner():
    assert ops_module.native_only(("a", "torch", "torch", "b", "torch")) == ("a", "a", "b", "b", "b")
    assert ops_module.native_only(("torch", "torch")) == ("torch", "torch")


class _FixedTuner:
    def __init__(self, winners):
        self._winners = winners

    def winners(self, out_features, in_features):
        return self._winners


@needs_kernels
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mixed_winners_dispatch_by_rows_and_match_torch(dtype, tol):
    ops = ops_module.Ops(True, "test", _FixedTuner(tuple("avx2" if s < 8 else "torch" for s in BUCKETS)))
    module = torch.nn.Module()
    weight = torch.randn(40, 24).to(dtype)
    module.weight = torch.nn.Parameter(weight.clone())
    ops.prepare([(module, "weight")])
    assert module.weight.packed and module.weight.dense is not None
    for rows in (1, 5, 8, 100):
        x = torch.randn(rows, 24).to(dtype)
        torch.testing.assert_close(ops.linear(x, module.weight).double(), F.linear(x, weight).double(),
                                   rtol=tol, atol=tol)


@needs_kernels
def test_an_autotuned_model_matches_hf_logits_with_both_paths(monkeypatch, tmp_path):
    """A float32 model under `auto`, its timings faked so that one prefill step (many rows) runs torch's matmul
    and decode (one row) the AVX2 one: prefill logits within the float32 tolerance of HF."""
    calls = []
    monkeypatch.setattr(autotune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(ops_module._LinearTimer, "__call__", lambda self, *args: split_timer(calls)(*args))
    hf = build_hf_model(seed=3, **PARITY_CONFIGS["tied-1kv"]).float()
    path = save_hf_model(hf, tmp_path / "model")
    prompts = [[(7 * i + 3 * j) % 1000 for j in range(n)] for i, n in enumerate((1, 5, 12))]
    engine = LLMEngine.from_args(str(path), dtype="float32", cpu_kernels="auto", block_size=4)
    model = engine.runner.model
    assert calls and all(isinstance(getattr(m, n), TunedWeight) for m, n in model.linear_weights())
    assert "timed once" in engine.runner.ops.note
    params = sum(t.numel() for t in (getattr(m, n) for m, n in model.linear_weights()) for t in t.tensors())
    assert params > sum(p.numel() for p in model.parameters())  # both forms kept where each wins somewhere
    ours = engine_logits(engine, prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits[:, : expected.shape[-1]].float(), expected, rtol=1e-3, atol=1e-3)
    assert cpu.PackedWeight not in {type(getattr(m, n)) for m, n in model.linear_weights()}


def test_processes_sharing_a_cache_keep_each_other_s_shapes(tmp_path):
    """Two tuners on one file (two replicas, say): each saves its own shape without dropping the other's, and a
    shape the other timed is read from the file, not timed again."""
    path = tmp_path / "linear.json"
    calls = []
    first = LinearTuner("k", split_timer(calls), ("avx2", "torch"), path)
    second = LinearTuner("k", split_timer(calls), ("avx2", "torch"), path)  # loaded before either saved
    first.winners(48, 32)
    second.winners(64, 16)
    assert set(json.loads(path.read_text())) == {"48x32", "64x16"}
    timed = len(calls)
    assert second.winners(48, 32) == first.winners(48, 32) and len(calls) == timed


@needs_kernels
def test_decode_sized_calls_are_timed_with_the_weight_flushed_from_the_caches(monkeypatch):
    """Up to STREAMING_ROWS rows each timed call first flushes the candidate's own weight (its layout's tensors) from
    the caches (a model's weights stream from memory there); larger calls are timed as they come; release drops
    the timing data."""
    flushed = []
    monkeypatch.setattr(ops_module.cpu, "flush_caches", lambda tensors: flushed.append(tensors))
    timer = ops_module._LinearTimer(torch.bfloat16)
    timer("avx2", ops_module._LinearTimer.STREAMING_ROWS, 40, 24)
    timer("torch", ops_module._LinearTimer.STREAMING_ROWS, 40, 24)
    assert [t.data_ptr() for t, in flushed] == [timer._weights["panels"].data.data_ptr(),
                                                timer._weights["torch"].data_ptr()]
    timer("torch", ops_module._LinearTimer.STREAMING_ROWS + 1, 40, 24)
    assert len(flushed) == 2
    timer.release()
    assert timer._weights == {} and timer._rows == {}


@needs_kernels
def test_the_flush_runs_clflushopt_where_the_cpu_has_it_and_keeps_the_contents(monkeypatch):
    """flush_caches takes the CLFLUSHOPT build where the CPU has the instruction, else CLFLUSH's; each build that
    runs here flushes a buffer whose length ends mid-line (and an empty one) and leaves its contents as they were."""
    loaded = []
    native = cpu.native_function
    monkeypatch.setattr(cpu, "native_function", lambda name: loaded.append(name) or native(name))
    buffer = torch.arange(1000, dtype=torch.float32)
    cpu.flush_caches([torch.zeros(0), buffer[:-3]])
    assert loaded[-1] == ("flush_lines_opt" if "clflushopt" in machine.cpu().flags else "flush_lines")
    for name in ("flush_lines_opt", "flush_lines"):
        if cpu.kernel_reason(name) is None:
            native(name)(buffer.data_ptr(), buffer.numel() * 4 - 3)
    assert torch.equal(buffer, torch.arange(1000, dtype=torch.float32))
