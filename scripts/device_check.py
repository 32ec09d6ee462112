"""One prepared run on a lent CUDA machine: the parity tests with the engine on the GPU, then greedy decode
throughput of mini-infer next to HF transformers `generate` on the Qwen2.5-0.5B shape (random weights).

Usage: python scripts/device_check.py OUT_DIR   (writes OUT_DIR/device_check.md and .json)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mini_infer import LLM, SamplingParams  # noqa: E402
from mini_infer.factory.checkpoint import GENERATION_CONFIG, PRESETS, random_weights, write_config  # noqa: E402

BATCH_SIZES = (1, 8, 32)
PROMPT_LEN, NEW_TOKENS = 32, 128


def run_parity_tests() -> str:
    env = dict(os.environ, MINI_INFER_TEST_DEVICE="cuda")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_parity.py"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    return result.stdout.strip().splitlines()[-1] if result.stdout else result.stderr[-2000:]


def write_checkpoint(out: Path) -> Path:
    """The 0.5B preset's config and random bf16 weights; no tokenizer (token-id prompts)."""
    config = PRESETS["qwen2.5-0.5b"]
    out.mkdir(parents=True)
    write_config(out, config)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    save_file(random_weights(config, seed=0, dtype=torch.bfloat16), out / "model.safetensors")
    return out


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    parity = run_parity_tests()
    print("parity on cuda:", parity, flush=True)
    from transformers import AutoModelForCausalLM

    model_dir = write_checkpoint(Path(tempfile.mkdtemp()) / "qwen2.5-0.5b")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", kv_cache_memory_gb=8.0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    hf.generation_config.eos_token_id = None
    rows = []
    for batch in BATCH_SIZES:
        prompts = torch.randint(0, 150000, (batch, PROMPT_LEN), generator=gen)
        ours = lambda: llm.generate(prompts.tolist(), params, use_tqdm=False)  # noqa: E731
        theirs = lambda: hf.generate(prompts.cuda(), attention_mask=torch.ones_like(prompts).cuda(),  # noqa: E731
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        ours(), theirs()  # warm-up
        t_ours = min(timed(ours) for _ in range(2))
        t_hf = min(timed(theirs) for _ in range(2))
        tokens = batch * NEW_TOKENS
        rows.append(dict(batch=batch, mini_infer_tok_s=tokens / t_ours, hf_generate_tok_s=tokens / t_hf,
                         ratio=t_hf / t_ours))
        print(rows[-1], flush=True)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, parity=parity, rows=rows,
                  prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, dtype="bfloat16")
    (out_dir / "device_check.json").write_text(json.dumps(report, indent=2))
    lines = [f"Device: {report['device']}, torch {report['torch']}; parity tests on cuda: {parity}", "",
             f"Greedy, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, bf16, best of 2 after a warm-up:", "",
             "| batch | mini-infer tok/s | HF generate tok/s | mini-infer / HF |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['mini_infer_tok_s']:.0f} | {r['hf_generate_tok_s']:.0f} | {r['ratio']:.2f} |"
              for r in rows]
    (out_dir / "device_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
