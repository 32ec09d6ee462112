"""The `mini-infer` command, and the engine's independence from transformers' modeling code."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import TEST_CACHE
from mini_infer.entrypoints.cli import main
from mini_infer.kernels.autotune import CANDIDATES

PACKAGE = Path(__file__).resolve().parents[1] / "mini_infer"


def test_make_model_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--seed", "3", "--dtype", "float32"]) == 0
    assert "tiny preset with random weights" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["vocab_size"] == 151936
    assert {p.name for p in out.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}


def test_generate_streams_text_and_reports_speed(tiny_model_dir, capsys):
    code = main(["generate", "--model", str(tiny_model_dir), "--chat", "Hello!", "--max-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert code == 0
    assert "[mini-infer] 6 tokens, finish_reason=length" in captured.err
    assert "tok/s" in captured.err
    assert "kernels:" not in captured.err


def test_generate_verbose_names_the_kernels_and_the_matmul_choices(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "Hi", "--max-tokens", "2", "--ignore-eos", "-v",
                 "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "[mini-infer] kernels: native CPU kernels" in err
    # Each weight shape's line starts with the path the autotuner chose for one row (any of its candidates: on a
    # Zen 4 every float32 shape took avx512/far there).
    first = re.findall(r"\[mini-infer\] matmul \d+x\d+: ([\w/]+) at 1\b", err)
    assert first and set(first) <= set(CANDIDATES), err


def test_generate_without_model_uses_the_cached_default(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from mini_infer.factory import default_model_dir

    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    for kept in ("kernels", "autotune"):  # the run's builds and timings: this test is about the model
        (TEST_CACHE / kept).mkdir(exist_ok=True)
        (tmp_path / kept).symlink_to(TEST_CACHE / kept)
    shutil.copytree(tiny_model_dir, default_model_dir())  # stands in for the 0.5B preset (too slow for tests)
    assert main(["generate", "Hi", "--max-tokens", "3", "--ignore-eos", "--seed", "1"]) == 0
    assert "[mini-infer] 3 tokens" in capsys.readouterr().err


def test_errors_exit_with_a_message(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "hi"]) == 2
    assert "model directory not found" in capsys.readouterr().err


def test_engine_never_imports_transformers_modeling_code(tiny_model_dir):
    """Generate through the engine in a fresh interpreter, then list what transformers brought in."""
    script = f"""
import sys
from mini_infer import LLM, SamplingParams
llm = LLM({str(tiny_model_dir)!r}, dtype="float32")
llm.chat([{{"role": "user", "content": "hi"}}], SamplingParams(max_tokens=2), use_tqdm=False)
print("\\n".join(m for m in sys.modules if m.startswith("transformers")))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    modules = result.stdout.split()
    assert "transformers.tokenization_utils_tokenizers" in modules  # it did load the tokenizer
    forbidden = [m for m in modules if "modeling" in m or "cache_utils" in m or m.startswith("transformers.generation")]
    assert forbidden == []


def test_package_imports_from_transformers_only_tokenization():
    """The engine uses transformers for tokenization only; the benchmark's HF baselines (bench/hf.py, imported
    only when an HF system is selected) are the one place that runs HF models."""
    allowed = {"transformers": {"PreTrainedTokenizerFast"}, "transformers.integrations.tiktoken": None}
    hf_baselines = PACKAGE / "bench" / "hf.py"
    for path in PACKAGE.rglob("*.py"):
        if path == hf_baselines:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("transformers") for a in node.names), path
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                assert node.module in allowed, (path, node.module)
                names = allowed[node.module]
                assert names is None or {a.name for a in node.names} <= names, (path, node.module)


def test_seed_flag_reaches_the_engine_config(tiny_model_dir):
    import argparse

    from mini_infer.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flags, seed in (([], 0), (["--seed", "7"], 7)):
        args = parser.parse_args(["--model", str(tiny_model_dir), *flags])
        assert EngineArgs.from_cli_args(args).create_engine_config().seed == seed
