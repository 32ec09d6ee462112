"""config.json parsing (both layouts) and safetensors loading: every problem is named with its path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_hf_model, save_hf_model, to_published_layout
from mini_infer import LLM
from mini_infer.config import EngineConfig, ModelConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_hf_model(seed=3, rope_theta=1e6, tie_word_embeddings=False)
    return save_hf_model(model, tmp_path_factory.mktemp("ckpt") / "model")


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    def make():
        return shutil.copytree(checkpoint, tmp_path / "copy")
    return make


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))


def test_both_config_layouts_parse_to_the_same_model_config(copy_of, checkpoint):
    published = copy_of()
    to_published_layout(published / "config.json")
    raw = json.loads((published / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_theta"] == 1e6 and "torch_dtype" in raw
    a, b = ModelConfig.from_dir(checkpoint), ModelConfig.from_dir(published)
    assert a == b
    assert a.rope_theta == 1e6 and a.torch_dtype == "float64"


def test_missing_rope_theta_is_an_error_not_a_default(copy_of):
    path = copy_of()
    edit_config(path, rope_parameters={"rope_type": "default"})
    with pytest.raises(ValueError, match=r"rope_theta is missing"):
        ModelConfig.from_dir(path)


def test_conflicting_rope_theta_is_an_error(copy_of):
    path = copy_of()
    edit_config(path, rope_theta=10000.0)
    with pytest.raises(ValueError, match=r"rope_theta=10000.0 disagrees"):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("changes,message", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"),
     r"MistralForCausalLM.*not supported; mini-infer runs Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), r"rope type 'yarn'"),
    (dict(use_sliding_window=True), r"sliding-window"),
    (dict(hidden_size=None), r"'hidden_size' is missing"),
    (dict(num_key_value_heads=3), r"not a multiple of num_key_value_heads=3"),
])
def test_bad_config_names_the_problem_and_path(copy_of, changes, message):
    path = copy_of()
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_dir(path)
    assert str(path / "config.json") in str(info.value)


def test_config_that_is_not_json(copy_of):
    path = copy_of()
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_dir(path)


def test_missing_directory_and_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found: .*nowhere"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _shorten(name):
    return lambda tensors: tensors.update({name: tensors[name][:-1].clone()})


def _add(name):
    return lambda tensors: tensors.update({name: torch.zeros(2, 2)})


@pytest.mark.parametrize("edit,message", [
    (_drop("model.layers.1.self_attn.k_proj.bias"), r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.bias"),
    (_shorten("model.layers.0.mlp.up_proj.weight"),
     r"model\.layers\.0\.mlp\.up_proj\.weight.*shape \(159, 64\), expected \(160, 64\)"),
    (_add("model.layers.5.mlp.up_proj.weight"), r"unexpected tensor 'model\.layers\.5\.mlp\.up_proj\.weight'"),
    # an untied checkpoint must carry its own head
    (_drop("lm_head.weight"), r"missing tensors: lm_head\.weight"),
], ids=["missing", "misshaped", "unexpected", "untied-without-head"])
def test_bad_tensors_are_named(copy_of, edit, message):
    path = copy_of()
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        LLM(str(path))


def test_pickle_checkpoints_are_refused(copy_of):
    path = copy_of()
    (path / "model.safetensors").unlink()
    torch.save({}, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only safetensors"):
        LLM(str(path))


def test_missing_shard_is_named(copy_of):
    path = copy_of()
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors.*missing"):
        LLM(str(path))


@pytest.mark.parametrize("dtype,expected", [("auto", torch.float64), ("bfloat16", torch.bfloat16),
                                            ("float16", torch.float16), ("float32", torch.float32),
                                            ("float64", torch.float64)])
def test_dtype_choices(checkpoint, dtype, expected):
    config = EngineConfig(model=str(checkpoint), dtype=dtype)
    assert config.torch_dtype == expected


def test_bad_engine_settings_name_the_field(checkpoint):
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        EngineConfig(model=str(checkpoint), dtype="int8")
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 1024\]"):
        EngineConfig(model=str(checkpoint), max_model_len=4096)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        EngineConfig(model=str(checkpoint), block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len .* without chunked"):
        EngineConfig(model=str(checkpoint), max_model_len=512, max_num_batched_tokens=100,
                     enable_chunked_prefill=False)
    assert EngineConfig(model=str(checkpoint), max_model_len=512, max_num_batched_tokens=100).max_num_batched_tokens \
        == 100  # chunked prefill (the default) spreads a longer prompt over several steps
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        EngineConfig(model=str(checkpoint), max_num_batched_tokens=0)
