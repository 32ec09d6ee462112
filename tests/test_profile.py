"""`mini-infer profile`: the decode-step breakdown on the tiny model (no timing comparisons)."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from mini_infer.bench.profile import OTHER, ROWS, add_profile_args, profile_decode_step, run_profile
from mini_infer.engine.llm_engine import LLMEngine

TINY = ["--batch-size", "2", "--prompt-len", "4", "--decode-steps-before", "2", "--steps", "2"]


def _parse(argv: list[str]) -> argparse.Namespace:
    return add_profile_args(argparse.ArgumentParser()).parse_args(argv)


def _check_breakdown(result: dict, moe: bool = False) -> None:
    """Each measured range is positive and together they fit inside the profiled step. The layers run either in one
    native call or op by op (then KV write and attention are their own rows); a mixture of experts' routing and
    experts are rows of their own."""
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == list(ROWS)
    by_op, stacked, sparse = ("KV write", "attention"), "decoder layers (one native call)", ("MoE routing", "experts")
    if rows[stacked]["ms"] > 0:
        assert all(rows[name]["ms"] == 0 for name in by_op), rows
    else:
        assert all(rows[name]["ms"] > 0 for name in by_op), rows
    assert all((rows[name]["ms"] > 0) == moe for name in sparse), rows
    assert all(rows[name]["ms"] > 0 for name in ROWS if name not in (OTHER, stacked, *by_op, *sparse)), rows
    assert 0 < result["measured_ms"] <= result["step_ms"] and result["unprofiled_step_ms"] > 0
    host = result["host_ms"]  # timed inside the unprofiled steps, each part of each step
    assert all(host[part] > 0 for part in ("schedule", "input_prep", "update", "outputs")), host
    assert host["total"] == pytest.approx(sum(v for k, v in host.items() if k != "total"))
    assert host["total"] < result["unprofiled_step_ms"]


def test_profile_prints_every_row_and_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prof"
    args = _parse([*TINY, "--model", str(tiny_model_dir), "--dtype", "float32", "--out", str(out), "--trace"])
    assert run_profile(args) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ROWS)
    assert "step total" in printed and "without the profiler" in printed and "host work without the profiler" in printed
    assert "kernels: native CPU kernels" in printed and "(autotuned):" in printed
    result = json.loads((out / "profile.json").read_text())
    assert result["matmul_choices"] and "timed once" in result["kernels"]
    assert (result["batch_size"], result["steps"], result["dtype"]) == (2, 2, "float32")
    # 4 prompt tokens + the prefill's token + 2 warm-up + 2 unprofiled decode steps precede the profiled ones
    assert result["context_len"] == 9
    _check_breakdown(result)
    assert (out / "profile.txt").read_text().strip() == printed.strip()
    assert json.loads((out / "trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize("cpu_kernels, layers_row", [("on", "decoder layers (one native call)"), ("off", "attention")])
def test_profile_decode_step_leaves_the_engine_idle(tiny_model_dir, cpu_kernels, layers_row):
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", cpu_kernels=cpu_kernels)
    result = profile_decode_step(engine, 3, prompt_len=5, decode_steps_before=1, steps=2)
    _check_breakdown(result)
    # (the host timers wrapped the engine's methods for the unprofiled steps only)
    assert not {"schedule", "update"} & vars(engine.scheduler).keys() and "_outputs" not in vars(engine)
    assert "prepare" not in vars(engine.runner)
    assert next(row for row in result["rows"] if row["name"] == layers_row)["ms"] > 0
    assert not engine.has_unfinished_requests() and engine.kv_cache_usage() == 0


def test_profile_runs_steps_scheduled_ahead(tiny_model_dir):
    """With async scheduling (a GPU's default) each timed step still decodes every request once: a step's tokens come
    in with the next one."""
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", async_scheduling=True)
    result = profile_decode_step(engine, 3, prompt_len=5, decode_steps_before=1, steps=2)
    _check_breakdown(result)
    assert not engine.has_unfinished_requests() and engine.kv_cache_usage() == 0


def test_a_mixture_of_experts_profiles_its_routing_and_its_experts(tmp_path):
    from mini_infer.factory import make_model

    model = make_model("qwen3-moe-tiny", tmp_path / "moe", dtype="float32")
    engine = LLMEngine.from_args(str(model), dtype="float32")
    result = profile_decode_step(engine, 3, prompt_len=5, decode_steps_before=1, steps=2)
    _check_breakdown(result, moe=True)


def test_other_is_the_time_outside_every_labelled_range(tiny_model_dir, monkeypatch):
    """Work the step does outside the labelled ranges lands in "other" and nowhere else: 30 ms slept per step where
    no range is open (while the engine merges its outputs) raise "other" by at least that, the ranges stay below it."""
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", cpu_kernels="off")
    grouped = engine._grouped
    monkeypatch.setattr(engine, "_grouped", lambda outputs: time.sleep(0.03) or grouped(outputs))
    result = profile_decode_step(engine, 2, prompt_len=4, decode_steps_before=1, steps=2)
    rows = {row["name"]: row["ms"] for row in result["rows"]}
    assert rows[OTHER] >= 30 and all(ms < 30 for name, ms in rows.items() if name != OTHER), rows


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "1"], "exceeds max_num_seqs"),
    (["--num-kv-blocks", "1"], "KV blocks"),
    (["--steps", "0"], "steps must be >= 1"),
])
def test_profile_refuses_sizes_it_cannot_measure(tiny_model_dir, flags, message):
    args = _parse([*TINY, "--model", str(tiny_model_dir), "--dtype", "float32", *flags])
    with pytest.raises(ValueError, match=message):
        run_profile(args)


def test_profile_passes_the_repetition_penalty_to_its_requests(tiny_model_dir, tmp_path, capsys):
    args = _parse([*TINY, "--model", str(tiny_model_dir), "--dtype", "float32", "--repetition-penalty", "1.3",
                   "--out", str(tmp_path)])
    assert run_profile(args) == 0
    assert "repetition penalty 1.3" in capsys.readouterr().out
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["repetition_penalty"] == 1.3 and result["context_len"] == 9
    _check_breakdown(result)


def test_profile_refuses_a_non_positive_repetition_penalty(tiny_model_dir):
    with pytest.raises(ValueError, match="--repetition-penalty must be > 0"):
        run_profile(_parse([*TINY, "--model", str(tiny_model_dir), "--repetition-penalty", "0"]))


def test_profile_with_the_model_s_sampling_defaults(tiny_model_dir, capsys):
    """--sampling model-defaults profiles what a request without sampling fields gets: generation_config's
    temperature, top_p, top_k and repetition penalty."""
    engine_defaults = LLMEngine.from_args(str(tiny_model_dir), dtype="float32").default_sampling_params()
    args = _parse([*TINY, "--model", str(tiny_model_dir), "--dtype", "float32", "--sampling", "model-defaults"])
    assert run_profile(args) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert f"temperature {engine_defaults.temperature:g}" in head and f"top_k {engine_defaults.top_k}" in head
    assert f"repetition penalty {engine_defaults.repetition_penalty:g}" in head
    with pytest.raises(ValueError, match="--repetition-penalty applies to --sampling greedy"):
        run_profile(_parse([*TINY, "--model", str(tiny_model_dir), "--sampling", "model-defaults",
                            "--repetition-penalty", "1.2"]))
