r"""Cross-check of the pre-quantised test fixtures against a third-party implementation, GPTQModel.

tests/test_prequantized.py checks that the loader's QuantizedTensor.dequantize() equals the test side's own
unpacking (tests/prequant_checkpoints.reference_dequantize) bit for bit; both were written from the formats'
documentation by this project, so a shared misreading would pass. This script builds every fixture of that test's
CASES and, for every projection, dequantises the tensors read back from the written model.safetensors three ways:

  (a) tests/prequant_checkpoints.reference_dequantize,
  (b) GPTQModel's own code (gptq_dequantize: TorchLinear.dequantize_weight after convert_gptq_v1_to_v2_format_module;
      awq_dequantize: packing_utils.dequantize_gemm), float32,
  (c) mini-infer's loader (the model tests/test_prequantized._loaded builds), each fused weight's dequantize() split
      back into its projections' rows,

and requires (a) == (b) == (c) exactly (torch.equal). A GPTQ checkpoint without act-order may leave g_idx out (the
fixtures do, for layer 0's down_proj): (a) and (b) then take the sequential g_idx, k // group_size, the value
GPTQModel's TorchLinear initialises that buffer to. GPTQModel's AWQ dequantisation takes whole groups only, so (b)
pads a partial group with zero codes and drops the padding (flagged per projection).

It then loads every fixture with transformers (AutoModelForCausalLM.from_pretrained with device_map="cpu" and
dtype=torch.float32, transformers 5's torch_dtype; optimum + GPTQModel's CPU kernels), runs one prompt and records
the largest logit difference from the float64 HF model write_quantized leaves behind (its projections set to the
reference weights), beside the float32 copy of that model's (plain float32 rounding), and how the loaded modules'
dequantize_weight() relates to the reference weights. transformers 5 does not fill a g_idx the checkpoint leaves
out (it reports it missing and leaves the buffer uninitialised), so such a checkpoint is loaded from a copy with the
sequential g_idx written in, as the output says. The GPTQ fixtures with act-order and without (HF_REQUIRED) must
load; another fixture's failure to load (GPTQModel refuses in_features that are not a multiple of group_size; an
AWQ load on the CPU might fail) is recorded, not an error. Last, v1_carry_probe records the one reading where
(a)/(c) and GPTQModel are known to differ, which no fixture contains.

Writes OUT.json (per case and projection the equal flags and max abs differences; the transformers results; the
probe; torch, gptqmodel, transformers and optimum versions; the CPU model and whether it has avx512_bf16) and OUT.md
(tables). Exits 1 if any (a)/(b)/(c) comparison is not exact or an HF_REQUIRED fixture does not load in
transformers, 2 if GPTQModel is not importable.

Runs under any python that has GPTQModel and the rest; mini_infer and the tests import from the repository as
they are. The side venv it was run in (any path will do) was made from scratch with

    python3 -m venv /tmp/gptqref
    /tmp/gptqref/bin/pip install torch==2.13.0
    echo "torch==2.13.0" > /tmp/gptqref/constraints.txt
    pip download --no-deps --no-binary :all: gptqmodel==7.7.0 -d /tmp/gptqdl
    /tmp/gptqref/bin/pip install --no-deps --no-build-isolation /tmp/gptqdl/gptqmodel-7.7.0.tar.gz
    /tmp/gptqref/bin/pip install -c /tmp/gptqref/constraints.txt "transformers==5.24.*" numpy safetensors \
        threadpoolctl packaging protobuf pillow requests pypcre tokenicer logbar device-smi dill defuser accelerate \
        torchao datasets pyarrow ninja optimum pytest==9.2.0

(GPTQModel built from its source against the torch already installed; the constraints file keeps the last install
from replacing that torch). pip resolved torch==2.13.0 to the 2.13.0+cpu build from the wheels its configuration
points at; elsewhere --index-url https://download.pytorch.org/whl/cpu asks for that build. Run from the repository
root:

    /tmp/gptqref/bin/python scripts/prequant_crosscheck.py --out docs/benchmarks/prequant-crosscheck
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

if importlib.util.find_spec("gptqmodel") is None:
    print(f"gptqmodel is not importable from {sys.executable}: make the side venv with the commands in this script's "
          f"docstring ({__file__}) and run the script with its python", file=sys.stderr)
    sys.exit(2)
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from gptqmodel.nn_modules.qlinear.torch import TorchLinear  # noqa: E402
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm  # noqa: E402
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module  # noqa: E402
from prequant_checkpoints import reference_dequantize, write_quantized  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_prequantized import CASES, _loaded, _model  # noqa: E402

from mini_infer.config import CheckpointQuantization  # noqa: E402
from mini_infer.model import prequantized  # noqa: E402

# transformers must load these (a failure fails the run); the other fixtures' loads are recorded as they go
HF_REQUIRED = ("gptq-int4-g32", "gptq-int4-act-order")
PROMPT = [1, 2, 3, 4, 5, 17, 42, 99, 200, 7, 150, 299, 0, 64, 128, 255, 31, 77]
# mini-infer's fused weights: (module, attribute) -> the checkpoint projections stacked in it, in order
FUSED = {("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         ("self_attn", "o_proj"): ("self_attn.o_proj",), ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
         ("mlp", "down_proj"): ("mlp.down_proj",)}


def in_features(stored: dict[str, torch.Tensor], settings: dict) -> int:
    rows = stored["qweight"].shape[0]
    return rows if settings["method"] == "awq" else rows * 32 // settings["bits"]


def group_of(stored: dict[str, torch.Tensor], settings: dict) -> int:
    return in_features(stored, settings) if settings["group_size"] == -1 else settings["group_size"]


def stored_layers(path: Path, settings: dict) -> tuple[dict[str, dict[str, torch.Tensor]], set[str]]:
    """model.safetensors' projections, prefix -> {qweight, qzeros, scales[, g_idx]}, each g_idx a GPTQ checkpoint
    leaves out filled in as the sequential k // group_size; and the prefixes whose g_idx was left out."""
    layers, omitted = {}, set()
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        prefix, suffix = name.rsplit(".", 1)
        if suffix in ("qweight", "qzeros", "scales", "g_idx"):
            layers.setdefault(prefix, {})[suffix] = tensor
    for prefix, stored in layers.items():
        if settings["method"] == "gptq" and "g_idx" not in stored:
            stored["g_idx"] = (torch.arange(in_features(stored, settings)) // group_of(stored, settings)).int()
            omitted.add(prefix)
    return layers, omitted


def gptq_dequantize(stored: dict[str, torch.Tensor], bits: int, group_size: int, v1: bool = True) -> torch.Tensor:
    """GPTQModel's GPTQ dequantisation, float32 [N, K]: a TorchLinear (eval mode) holding the packed tensors, a v1
    checkpoint's qzeros first converted in place to v2 with convert_gptq_v1_to_v2_format_module as GPTQModel's
    loader does, then TorchLinear.dequantize_weight(). The scales go in as float32 so that the products are exact
    (float16 scale times a small integer). The groups come from g_idx: group_size, sym and desc_act only size and
    fill the module's initial buffers, all replaced here."""
    k, n = stored["g_idx"].numel(), stored["scales"].shape[1]
    module = TorchLinear(bits=bits, group_size=group_size, sym=True, desc_act=True, in_features=k, out_features=n,
                         bias=False, pack_dtype=torch.int32).eval()
    module.qweight = stored["qweight"].int()
    module.qzeros = stored["qzeros"].int().clone()
    module.scales = stored["scales"].float()
    module.g_idx = stored["g_idx"].int()
    if v1:
        convert_gptq_v1_to_v2_format_module(module, bits=bits, pack_dtype=torch.int32)
    return module.dequantize_weight().T.contiguous().float()


def awq_dequantize(stored: dict[str, torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    """GPTQModel's AWQ (GEMM layout) dequantisation, float32 [N, K]: packing_utils.dequantize_gemm, the function
    AwqTorchLinear.forward uses, with the scales as float32 (exact products, as in gptq_dequantize)."""
    weight = dequantize_gemm(qweight=stored["qweight"].int(), qzeros=stored["qzeros"].int(),
                             scales=stored["scales"].float(), bits=bits, group_size=group_size)
    return weight.T.contiguous().float()


def gptqmodel_dequantize(stored: dict[str, torch.Tensor], settings: dict) -> tuple[torch.Tensor, bool]:
    """(b), and whether the inputs were padded to whole groups: GPTQModel's dequantize_gemm repeats each AWQ
    group's scales and zeros group_size times, so it takes whole groups only; a partial last group (or one group
    larger than the layer) is run with zero codes padded in and the padding's columns dropped after."""
    if settings["method"] == "gptq":
        return gptq_dequantize(stored, settings["bits"], settings["group_size"], settings.get("v1", True)), False
    k, group = in_features(stored, settings), group_of(stored, settings)
    padded = stored["scales"].shape[0] * group
    qweight = torch.cat([stored["qweight"], stored["qweight"].new_zeros(padded - k, stored["qweight"].shape[1])])
    weight = awq_dequantize({**stored, "qweight": qweight}, settings["bits"], group)
    return weight[:, :k].contiguous(), padded != k


def mini_infer_weights(path: Path, out_features: dict[str, int]) -> dict[str, torch.Tensor]:
    """Each projection's weight [N, K] as mini-infer's loader holds it: its rows of the fused weight's dequantize()
    (out_features: prefix -> N)."""
    model = _loaded(str(path))
    weights = {}
    for i, layer in enumerate(model.layers):
        for (module, attr), names in FUSED.items():
            prefixes = [f"model.layers.{i}.{name}" for name in names]
            fused = getattr(getattr(layer, module), attr).dequantize()
            weights.update(zip(prefixes, fused.split([out_features[prefix] for prefix in prefixes])))
    return weights


def max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().max().item()


def compare_case(path: Path, settings: dict) -> dict[str, dict]:
    """(a) test-side, (b) GPTQModel and (c) mini-infer dequantisation of every projection of one fixture."""
    layers, omitted = stored_layers(path, settings)
    ours = mini_infer_weights(path, {prefix: stored["scales"].shape[1] for prefix, stored in layers.items()})
    rows = {}
    for prefix, stored in layers.items():
        a = reference_dequantize(settings["method"], stored, settings["bits"], settings["group_size"],
                                 in_features(stored, settings), settings.get("v1", True))
        b, padded = gptqmodel_dequantize(stored, settings)
        c = ours[prefix]
        rows[prefix] = {"shape": list(a.shape), "g_idx_omitted": prefix in omitted, "b_padded_to_whole_groups": padded,
                        "a_eq_b": torch.equal(a, b), "a_eq_c": torch.equal(a, c), "b_eq_c": torch.equal(b, c),
                        "max_abs_a_b": max_diff(a, b), "max_abs_a_c": max_diff(a, c), "max_abs_b_c": max_diff(b, c)}
    return rows


def with_sequential_g_idx(path: Path, settings: dict) -> Path:
    """A copy of the checkpoint with each omitted g_idx written in (k // group_size)."""
    copy_dir = path.with_name(path.name + "-g_idx")
    shutil.copytree(path, copy_dir)
    tensors = load_file(str(path / "model.safetensors"))
    layers, omitted = stored_layers(path, settings)
    tensors.update({f"{prefix}.g_idx": layers[prefix]["g_idx"] for prefix in omitted})
    save_file(tensors, str(copy_dir / "model.safetensors"))
    return copy_dir


def transformers_check(path: Path, settings: dict, hf_model, reference: dict[str, torch.Tensor]) -> dict:
    """Load the checkpoint with transformers (GPTQModel's kernels), run PROMPT, compare with the float64 model."""
    from transformers import AutoModelForCausalLM

    def load(directory: Path):
        return AutoModelForCausalLM.from_pretrained(str(directory), device_map="cpu", dtype=torch.float32,
                                                    output_loading_info=True)

    result = {}
    try:
        model, info = load(path)
        if info["missing_keys"]:
            result["missing_keys_reported"] = sorted(info["missing_keys"])
            if not all(key.endswith(".g_idx") for key in info["missing_keys"]):
                raise RuntimeError(f"transformers reports missing tensors: {result['missing_keys_reported']}")
            model, info = load(with_sequential_g_idx(path, settings))
            result["loaded_with_sequential_g_idx_written_in"] = True
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            logits = model(ids).logits[0]
            exact = hf_model(ids).logits[0]
            float32 = copy.deepcopy(hf_model).float()(ids).logits[0]
        result.update(kernel=type(model.get_submodule(next(iter(reference)))).__name__,
                      logits_dtype=str(logits.dtype).removeprefix("torch."),
                      max_abs_logit_diff=max_diff(logits, exact), max_abs_logit=exact.abs().max().item(),
                      float32_reference_max_abs_logit_diff=max_diff(float32, exact))
        with torch.no_grad():
            held = {prefix: model.get_submodule(prefix).dequantize_weight().T for prefix in reference}
        result.update(weights_dtype=str(next(iter(held.values())).dtype).removeprefix("torch."),
                      weights_equal_reference_rounded_to_float16=all(
                          torch.equal(w.float(), reference[p].half().float()) for p, w in held.items()),
                      weights_max_abs_diff_from_reference=max(max_diff(w, reference[p]) for p, w in held.items()))
    except Exception as error:  # noqa: BLE001 - recorded; main fails the run for HF_REQUIRED
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def v1_carry_probe() -> dict:
    """Where (a) and (c) are known to part from GPTQModel, outside the fixtures (whose v1 checkpoints are all
    symmetric, zero 8 or 128): a v1 zero field of all ones, what a v1 packer stores for a zero point of 0 (as -1).
    The documented reading (a, c) takes field + 1 = 16; GPTQModel's v1 -> v2 conversion adds 1 to every field of
    the word at once, so that field wraps to 0 and its carry raises the next column's zero by one. One 4-bit layer,
    codes 3, scales 0.5, zero fields 7 but column 0's of group 0; the zero each reading implies for columns 0, 1."""
    k, n, group = 64, 16, 32
    qzeros = torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32)
    qzeros[0, 0] = 0x7777777F
    stored = {"qweight": torch.full((k // 8, n), 0x33333333, dtype=torch.int32), "qzeros": qzeros,
              "scales": torch.full((k // group, n), 0.5, dtype=torch.float16),
              "g_idx": (torch.arange(k) // group).int()}
    weights = {"a": reference_dequantize("gptq", stored, 4, group, k),
               "b": gptq_dequantize(stored, 4, group),
               "c": prequantized.unpack(CheckpointQuantization("gptq", 4, group, zero_offset=1), stored, n, k,
                                        "probe").dequantize()}
    return {"zeros_of_columns_0_1": {name: [3 - w[col, 0].item() / 0.5 for col in (0, 1)]
                                     for name, w in weights.items()},
            "a_eq_b": torch.equal(weights["a"], weights["b"]), "a_eq_c": torch.equal(weights["a"], weights["c"])}


def environment() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    return {"versions": {name: importlib.metadata.version(name)
                         for name in ("torch", "gptqmodel", "transformers", "optimum")},
            "cpu": fields.get("model name"), "avx512_bf16": "avx512_bf16" in fields.get("flags", "").split()}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# Pre-quantised fixtures: test-side vs GPTQModel vs mini-infer dequantisation", "",
             f"`{report['command']}`; "
             + ", ".join(f"{name} {version}" for name, version in env["versions"].items())
             + f"; {env['cpu']} (avx512_bf16: {'yes' if env['avx512_bf16'] else 'no'}).", "",
             "(a) tests/prequant_checkpoints.reference_dequantize, (b) GPTQModel (the script's gptq_dequantize: "
             "TorchLinear.dequantize_weight after the v1->v2 conversion; awq_dequantize: "
             "packing_utils.dequantize_gemm), (c) mini-infer's loader (QuantizedTensor.dequantize, fused rows split "
             "back); all float32 [N, K], compared with torch.equal over every projection of both layers.", "",
             "| case | projections | (a) = (b) | (a) = (c) | (b) = (c) | max abs (a)-(b) | max abs (a)-(c) |",
             "|---|---|---|---|---|---|---|"]
    for case, entry in report["cases"].items():
        rows = entry["projections"].values()
        lines.append(f"| {case} | {len(rows)} | " + " | ".join(
            "yes" if all(row[key] for row in rows) else "**no**" for key in ("a_eq_b", "a_eq_c", "b_eq_c"))
            + " | " + " | ".join(f"{max(row[key] for row in rows):.3g}" for key in ("max_abs_a_b", "max_abs_a_c"))
            + " |")
    lines += ["", f"transformers `from_pretrained(device_map='cpu', dtype=float32)` (optimum + GPTQModel kernels), "
              f"prompt of {len(PROMPT)} token ids, logits vs the float64 HF model of the reference weights:", "",
              "| case | kernel | max abs logit diff | float32 reference's | loaded weights = fp16(reference) | "
              "max abs weight diff | note |", "|---|---|---|---|---|---|---|"]
    for case, entry in report["transformers"].items():
        if "error" in entry:
            lines.append(f"| {case} | - | - | - | - | - | failed: {entry['error'][:200]} |")
            continue
        note = ("transformers reports the omitted g_idx missing and leaves it uninitialised: loaded from a copy with "
                "k // group_size written in" if entry.get("loaded_with_sequential_g_idx_written_in") else "")
        lines.append(f"| {case} | {entry['kernel']} | {entry['max_abs_logit_diff']:.3g} | "
                     f"{entry['float32_reference_max_abs_logit_diff']:.3g} | "
                     f"{'yes' if entry['weights_equal_reference_rounded_to_float16'] else 'no'} | "
                     f"{entry['weights_max_abs_diff_from_reference']:.3g} | {note} |")
    lines += ["", f"Largest |logit| {max((e.get('max_abs_logit', 0) for e in report['transformers'].values())):.3g}. "
              "With float32 activations GPTQModel's CPU kernels dequantise the weights in the scales' dtype "
              "(float16) and multiply in float32, so the logits differ by that rounding, not by any unpacking "
              "difference.", ""]
    padded = [case for case, entry in report["cases"].items()
              if any(row["b_padded_to_whole_groups"] for row in entry["projections"].values())]
    if padded:
        lines += [f"(b) for {', '.join(padded)}: GPTQModel's dequantize_gemm takes whole groups only, so the layers "
                  "whose in_features are not a multiple of group_size were padded with zero codes to whole groups "
                  "and the padding dropped.", ""]
    probe = report["v1_carry_probe"]["zeros_of_columns_0_1"]
    lines += ["Outside the fixtures (their v1 checkpoints are symmetric): a v1 zero field of all ones (a zero point "
              "of 0 stored as -1) reads as zero points (columns 0, 1) " + ", ".join(
                  f"({name}) {zeros[0]:g}, {zeros[1]:g}" for name, zeros in probe.items())
              + ": (a) and (c) add 1 to the field; GPTQModel's v1 -> v2 conversion adds 1 to the whole word, so the "
              "field wraps to 0 and carries into the next column.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output path without extension: OUT.json and OUT.md")
    args = parser.parse_args()
    report = {"command": f"{sys.executable} scripts/prequant_crosscheck.py --out {args.out}",
              "environment": environment(), "cases": {}, "transformers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (case, settings) in enumerate(CASES.items()):
            hf_model = _model(seed)
            path, reference = write_quantized(hf_model, Path(tmp) / case / "model", seed=seed, **settings)
            rows = compare_case(path, settings)
            equal = all(row["a_eq_b"] and row["a_eq_c"] and row["b_eq_c"] for row in rows.values())
            report["cases"][case] = {"settings": settings, "all_equal": equal, "projections": rows}
            print(f"{case}: {len(rows)} projections, (a) == (b) == (c): {equal}", flush=True)
            report["transformers"][case] = transformers_check(path, settings, hf_model, reference)
            print(f"{case}: transformers {report['transformers'][case]}", flush=True)
    report["v1_carry_probe"] = v1_carry_probe()
    report["all_equal"] = all(entry["all_equal"] for entry in report["cases"].values())
    required_failed = [case for case in HF_REQUIRED if "error" in report["transformers"][case]]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_name(out.name + ".md").write_text(markdown(report))
    print(f"all (a) == (b) == (c): {report['all_equal']}; wrote {out}.json and {out}.md")
    return 0 if report["all_equal"] and not required_failed else 1


if __name__ == "__main__":
    sys.exit(main())
