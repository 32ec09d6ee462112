"""The Qwen2.5-1.5B and 7B presets (speculative decoding's targets for the 0.5B draft) and make_model's sharded write,
which holds one shard in memory at a time. Cheap: the presets are written at a tiny size (their vocabularies, heads'
ratios and other fields kept), nothing large is written."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mini_infer import LLM, SamplingParams
from mini_infer.factory import PRESETS, checkpoint, make_model, parameter_count
from mini_infer.model.loader import checkpoint_files

# Layers, widths and heads cut down; vocab_size, tie_word_embeddings, rope_theta, the window fields stay the preset's.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_window_layers": 2}
# The engine checks here are about loading: torch's matmuls, so that no LM head of 152,064 rows is autotuned (~13 s).
ENGINE = {"dtype": "float32", "cpu_kernels": "off"}
QWEN25_COMMON = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 32768, "use_sliding_window": False,
    "use_cache": True, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_dir) -> Path:
    """The session's tiny model's tokenizer: each model below copies it (make_model's tokenizer_from)."""
    return tiny_model_dir


def _tiny(preset: str, out: Path, tokenizer_dir: Path, **kwargs) -> Path:
    return make_model(preset, out, overrides=TINY, tokenizer_from=tokenizer_dir, **kwargs)


def test_qwen25_15b_preset_matches_published_config():
    """Qwen2.5-1.5B-Instruct's config.json: 28 layers of 1536, GQA 12 over 2 heads of 128, tied head: 1.54B."""
    assert PRESETS["qwen2.5-1.5b"] == {
        **QWEN25_COMMON, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_window_layers": 21, "sliding_window": 32768,
    }
    assert parameter_count(PRESETS["qwen2.5-1.5b"]) == 1_543_714_304
    assert "lm_head.weight" not in checkpoint.tensor_shapes(PRESETS["qwen2.5-1.5b"])


def test_qwen25_7b_preset_matches_published_config():
    """Qwen2.5-7B-Instruct's config.json in full: 28 layers of 3584, GQA 28 over 4 heads of 128, untied head."""
    assert PRESETS["qwen2.5-7b"] == {
        **QWEN25_COMMON, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
        "max_window_layers": 28, "sliding_window": 131072,
    }
    assert parameter_count(PRESETS["qwen2.5-7b"]) == 7_615_616_512


def test_presets_split_into_shards_as_published():
    """bf16 at 4 GB a shard: 0.5B and 1.5B one model.safetensors, 7B the published four files (15,231,233,024 bytes,
    the total_size of Qwen2.5-7B-Instruct's index)."""

    def sizes(preset):
        shapes = checkpoint.tensor_shapes(PRESETS[preset])
        return [sum(torch.Size(shapes[name]).numel() * 2 for name in names)
                for names in checkpoint.shard_plan(PRESETS[preset], torch.bfloat16)]

    assert sizes("qwen2.5-0.5b") == [988_065_536]
    assert sizes("qwen2.5-1.5b") == [3_087_428_608]
    assert sizes("qwen2.5-7b") == [3_945_417_728, 3_864_715_264, 3_864_715_264, 3_556_384_768]
    plan = checkpoint.shard_plan(PRESETS["qwen2.5-7b"], torch.bfloat16)
    assert [name for names in plan for name in names] == list(checkpoint.tensor_shapes(PRESETS["qwen2.5-7b"]))
    # a tensor larger than a shard gets a file of its own
    assert checkpoint.shard_plan(PRESETS["tiny"], torch.bfloat16, max_shard_bytes=1)[0] == ["model.embed_tokens.weight"]


@pytest.mark.parametrize("preset", ["qwen2.5-1.5b", "qwen2.5-7b"])
def test_presets_write_at_a_tiny_size(preset, tmp_path, tokenizer_dir):
    out = _tiny(preset, tmp_path / preset, tokenizer_dir)
    config = json.loads((out / "config.json").read_text())
    kept = ("vocab_size", "tie_word_embeddings", "rope_theta", "max_position_embeddings", "sliding_window",
            "use_sliding_window", "bos_token_id", "eos_token_id", "rms_norm_eps")
    assert {key: config[key] for key in kept} == {key: PRESETS[preset][key] for key in kept}
    assert {key: config[key] for key in TINY} == TINY
    assert not (out / "model.safetensors.index.json").exists()
    written = load_file(out / "model.safetensors")
    assert set(written) == set(checkpoint.tensor_shapes({**PRESETS[preset], **TINY}))
    assert ("lm_head.weight" in written) == (not PRESETS[preset]["tie_word_embeddings"])
    assert written["model.embed_tokens.weight"].shape == (PRESETS[preset]["vocab_size"], 64)
    for name, tensor in written.items():  # every tensor perturbed: no zero biases, no all-ones norms
        assert tensor.dtype == torch.bfloat16
        if name.endswith(".bias"):
            assert (tensor != 0).all(), name
        if name.endswith("norm.weight"):
            assert (tensor != 1).any(), name


def test_sharded_write_is_the_same_checkpoint(tmp_path, tokenizer_dir):
    """Past max_shard_bytes the weights go to HF's shards and index: the same tensors, bit for bit, which our loader
    lists and transformers reads (the loader's reading of shards: tests/test_loader.py)."""
    from transformers import AutoModelForCausalLM

    single = _tiny("qwen2.5-7b", tmp_path / "single", tokenizer_dir)
    sharded = _tiny("qwen2.5-7b", tmp_path / "sharded", tokenizer_dir, max_shard_bytes=100_000)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                         for i in range(1, len(files) + 1)]
    assert checkpoint_files(sharded) == [sharded / name for name in files]
    shards = {name: load_file(sharded / name) for name in files}
    assert {tensor: file for file, tensors in shards.items() for tensor in tensors} == index["weight_map"]
    merged = {name: tensor for tensors in shards.values() for name, tensor in tensors.items()}
    reference = load_file(single / "model.safetensors")
    assert merged.keys() == reference.keys() and all(torch.equal(merged[n], reference[n]) for n in reference)
    assert index["metadata"]["total_size"] == sum(tensor.nbytes for tensor in reference.values())
    assert all((sharded / name).stat().st_mode & 0o777 == 0o644 for name in files)

    model, info = AutoModelForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, reference["lm_head.weight"])


def test_a_write_holds_one_shard_at_a_time(tmp_path, tokenizer_dir, monkeypatch):
    """Each shard's tensors are gone before the next shard is sampled, and no shard is past max_shard_bytes."""
    sample = checkpoint.random_weights
    alive: list[weakref.ref] = []
    shard_bytes = []

    def tracked(config, seed, dtype, names=None):
        assert names is not None, "sampled the whole model at once"
        assert not [ref for ref in alive if ref() is not None], "the previous shard is still in memory"
        tensors = sample(config, seed, dtype, names)
        alive.extend(weakref.ref(tensor) for tensor in tensors.values())
        shard_bytes.append(sum(tensor.nbytes for tensor in tensors.values()))
        return tensors

    monkeypatch.setattr(checkpoint, "random_weights", tracked)
    limit = 100_000
    _tiny("qwen2.5-1.5b", tmp_path / "m", tokenizer_dir, max_shard_bytes=limit)
    embedding = PRESETS["qwen2.5-1.5b"]["vocab_size"] * TINY["hidden_size"] * 2
    assert len(shard_bytes) >= 3 and shard_bytes[0] == embedding  # alone: larger than a shard
    assert all(size <= limit for size in shard_bytes[1:])


def test_a_tiny_05b_draft_speculates_for_a_tiny_7b_target(tmp_path, tokenizer_dir):
    """The benchmark's pairing: the 0.5B's vocabulary (151,936) drafting for the 7B's (152,064, padded), greedy
    tokens unchanged by speculation."""
    target = _tiny("qwen2.5-7b", tmp_path / "target", tokenizer_dir)
    draft = make_model("qwen2.5-0.5b", tmp_path / "draft", overrides={**TINY, "num_hidden_layers": 1},
                       tokenizer_from=tokenizer_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(target), **ENGINE).generate(["Hello, world"], greedy, use_tqdm=False)
    spec = LLM(str(target), **ENGINE, speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    assert spec.generate(["Hello, world"], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        plain[0].outputs[0].token_ids


def test_qwen3_30b_a3b_preset_has_transformers_own_parameters():
    """Qwen3-30B-A3B's shape: the tensors transformers' Qwen3MoeForCausalLM holds (counted on the meta device,
    experts fused there, per expert here), 30.5B parameters; a decode step of one token reads 3.04B of them (8 of
    128 experts a layer, the LM head, not the embedding)."""
    import transformers

    from mini_infer.config import ModelConfig

    preset = PRESETS["qwen3-30b-a3b"]
    config = transformers.Qwen3MoeConfig(**{key: value for key, value in preset.items() if key != "architectures"})
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    assert parameter_count(preset) == sum(p.numel() for p in model.parameters()) == 30_532_122_624
    assert ModelConfig.from_dict(preset).decode_weights == 3_041_656_832
