"""Tests for the random-weight checkpoint factory and the rebuilt Qwen2.5 tokenizer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mini_infer.factory import (
    PRESETS,
    default_model_dir,
    ensure_default_model,
    make_model,
    parameter_count,
    write_tokenizer,
)
from mini_infer.factory import checkpoint, tokenizer
from mini_infer.paths import cache_dir

ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]
DEFAULT_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory) -> Path:
    """A private cache for this module's tests, so the tokenizer is converted once here and never read from (or
    written to) the user's cache. Module-scoped: session scope left every later test module on it, so each
    process they spawned rebuilt the native kernels and re-timed the matmuls, and the peers looked not set up."""
    path = tmp_path_factory.mktemp("mini-infer-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINI_INFER_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def tokenizer_dir(module_cache, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_tokenizer_encodes_like_qwen(hf_tokenizer):
    assert type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    assert hf_tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert hf_tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert hf_tokenizer.convert_tokens_to_ids(ADDED_TOKENS) == list(range(151643, 151665))
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (151645, 151643)
    assert hf_tokenizer.bos_token is None


def test_tokenizer_special_flags(tokenizer_dir):
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    assert [(t["id"], t["content"]) for t in added] == list(enumerate(ADDED_TOKENS, start=151643))
    assert [t["special"] for t in added] == [True] * 14 + [False] * 8
    assert not any(t["normalized"] for t in added)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    assert [decoder[str(i)]["content"] for i in range(151643, 151665)] == ADDED_TOKENS
    assert [decoder[str(i)]["special"] for i in range(151643, 151665)] == [True] * 14 + [False] * 8


def test_tokenizer_round_trips_unicode(hf_tokenizer):
    text = "你好，世界！Grüße 🙂👨‍👩‍👧 12345\n\tend"
    ids = hf_tokenizer.encode(text)
    assert ids[:4] == [108386, 3837, 99489, 6313]  # 你好 ， 世界 ！
    assert hf_tokenizer.decode(ids) == text
    # single-digit pre-tokenization: each digit is its own token
    assert hf_tokenizer.encode("2024") == [17, 15, 17, 19]


def test_chat_template_without_system(hf_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"


def test_chat_template_with_system_and_generation_prompt(hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == expected
    encoded = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert encoded["input_ids"] == hf_tokenizer.encode(expected)


def test_tokenizer_cache_is_reused(module_cache, tokenizer_dir, tmp_path, monkeypatch):
    cached = list((module_cache / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(tokenizer, "_build_tokenizer_json", lambda _: pytest.fail("rebuilt a cached tokenizer"))
    write_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == cached[0].read_bytes()


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MINI_INFER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mini-infer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "mini-infer"


def test_missing_dashscope_names_the_package(monkeypatch):
    monkeypatch.setattr(tokenizer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="dashscope"):
        tokenizer.qwen_vocab_path()


def test_tiny_model_loads_and_runs_in_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    written = load_file(tiny_dir / "model.safetensors")
    assert torch.equal(model.model.embed_tokens.weight, written["model.embed_tokens.weight"])
    assert torch.equal(model.model.layers[1].self_attn.k_proj.bias, written["model.layers.1.self_attn.k_proj.bias"])
    with torch.no_grad():
        logits = model(torch.tensor([[9707, 11, 1879, 0]])).logits
    assert logits.shape == (1, 4, 151936)
    assert torch.isfinite(logits).all()
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_untied_head_is_written_and_loaded(tmp_path):
    from transformers import AutoModelForCausalLM

    out = make_model("tiny", tmp_path / "untied", dtype="float32", overrides={"tie_word_embeddings": False})
    written = load_file(out / "model.safetensors")
    assert not torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, written["lm_head.weight"])


def test_weights_are_all_perturbed(tiny_dir):
    written = load_file(tiny_dir / "model.safetensors")
    assert set(written) == set(checkpoint.tensor_shapes(PRESETS["tiny"]))
    assert "lm_head.weight" not in written  # tied
    biases = [name for name in written if name.endswith(".bias")]
    norms = [name for name in written if name.endswith("norm.weight")]
    assert len(biases) == 2 * 3 and len(norms) == 2 * 2 + 1
    for name in biases:
        assert (written[name] != 0).all(), name
    for name in norms:
        assert (written[name] != 1).any(), name
        assert (written[name].float() - 1).abs().mean() < 0.2, name
    assert all(tensor.dtype == torch.bfloat16 for tensor in written.values())


@pytest.mark.parametrize("layout", ["published", "transformers5"])
def test_config_layouts_load_in_transformers(tmp_path, layout):
    from transformers import AutoConfig

    checkpoint.write_config(tmp_path, PRESETS["qwen2.5-0.5b"], layout)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.rope_parameters["rope_theta"] == 1e6
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (896, 24, 2)
    assert config.tie_word_embeddings and not config.use_sliding_window
    if layout == "published":
        assert raw["rope_theta"] == 1e6 and raw["rope_scaling"] is None and raw["torch_dtype"] == "bfloat16"
    else:
        assert "rope_theta" not in raw and "torch_dtype" not in raw and raw["dtype"] == "bfloat16"
        assert raw["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
        assert raw["layer_types"] == ["full_attention"] * 24


def test_layouts_describe_the_same_model(tmp_path):
    from transformers import AutoConfig

    configs = []
    for layout in ("published", "transformers5"):
        (tmp_path / layout).mkdir()
        checkpoint.write_config(tmp_path / layout, PRESETS["tiny"], layout)
        config = AutoConfig.from_pretrained(tmp_path / layout).to_dict()
        config.pop("_name_or_path")
        configs.append(config)
    assert configs[0] == configs[1]


def test_seed_determines_weights(tmp_path):
    first = load_file(make_model("tiny", tmp_path / "a", seed=7) / "model.safetensors")
    again = load_file(make_model("tiny", tmp_path / "b", seed=7) / "model.safetensors")
    other = load_file(make_model("tiny", tmp_path / "c", seed=8) / "model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)


def test_dtype_is_applied_to_weights_and_config(tmp_path):
    out = make_model("tiny", tmp_path / "fp16", dtype="float16", layout="transformers5")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert all(t.dtype == torch.float16 for t in load_file(out / "model.safetensors").values())


def test_invalid_arguments_raise_value_error_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"preset.*qwen2\.5-0\.5b.*tiny"):
        make_model("qwen-7b", tmp_path / "m")
    with pytest.raises(ValueError, match="dtype"):
        make_model("tiny", tmp_path / "m", dtype="int8")
    with pytest.raises(ValueError, match="layout"):
        make_model("tiny", tmp_path / "m", layout="gguf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="out_dir"):
        make_model("tiny", tmp_path / "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_failed_write_leaves_no_partial_model(tmp_path, monkeypatch):
    def crash(*_):
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "write_tokenizer", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        make_model("tiny", tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_qwen25_05b_preset_matches_published_config():
    preset = PRESETS["qwen2.5-0.5b"]
    assert preset == {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "attention_dropout": 0.0, "initializer_range": 0.02,
        "max_window_layers": 21, "sliding_window": 32768, "use_sliding_window": False, "use_cache": True,
        "rope_scaling": None, "torch_dtype": "bfloat16",
    }
    assert parameter_count(preset) == 494_032_768


def test_qwen25_7b_preset_matches_published_config():
    """Qwen2.5-7B-Instruct's shape: 28 layers of 3584, GQA 28 over 4 heads of 128, an untied head: 7.62B parameters."""
    preset = PRESETS["qwen2.5-7b"]
    assert {key: preset[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "vocab_size",
                                         "tie_word_embeddings", "rope_theta", "max_position_embeddings")} == {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768}
    assert parameter_count(preset) == 7_615_616_512
    assert "lm_head.weight" in checkpoint.tensor_shapes(preset)


def test_tokenizer_from_copies_another_models_tokenizer(tiny_dir, tmp_path, monkeypatch):
    """Where dashscope is missing (a GPU machine), a model written elsewhere lends its tokenizer files."""
    monkeypatch.setattr(tokenizer, "qwen_vocab_path", lambda: (_ for _ in ()).throw(ImportError("no dashscope")))
    out = make_model("tiny", tmp_path / "copied", tokenizer_from=tiny_dir)
    for name in checkpoint.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_from: .*tokenizer.json, .*tokenizer_config.json not found"):
        make_model("tiny", tmp_path / "none", tokenizer_from=tmp_path)
    assert not (tmp_path / "none").exists()


def test_ensure_default_model_writes_once(module_cache, monkeypatch):
    written = []

    def fake_make_model(preset, out_dir):
        # The real 0.5B write is too slow for the suite; the tiny preset exercises the same path.
        written.append(preset)
        return make_model("tiny", out_dir)

    monkeypatch.setattr(checkpoint, "make_model", fake_make_model)
    messages = []
    path = ensure_default_model(log=messages.append)
    assert path == default_model_dir() == module_cache / "models" / "qwen2.5-0.5b-random"
    assert written == ["qwen2.5-0.5b"] and (path / "model.safetensors").is_file()
    assert len(messages) == 1 and str(path) in messages[0] and "random" in messages[0].lower()
    assert ensure_default_model(log=messages.append) == path
    assert written == ["qwen2.5-0.5b"] and len(messages) == 1
    # A default model written by an earlier mini-infer (its chat template without tools) gets today's template.
    config_path = path / "tokenizer_config.json"
    old = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**old, "chat_template": "{{ messages[0]['content'] }}"}))
    assert ensure_default_model(log=messages.append) == path
    assert json.loads(config_path.read_text()) == old and "chat template" in messages[-1]
    assert written == ["qwen2.5-0.5b"] and len(messages) == 2
