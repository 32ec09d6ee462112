"""Random-weight checkpoints in Hugging Face format: Qwen2.5 shapes, and tiny Qwen3 and Llama 3.2-style ones (a
Qwen3-Embedding-shape and a Qwen3-Reranker-shape one among them).

Owns the model presets, both config.json layouts, the weight generator and the default model dir.
"""

import copy
import errno
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from mini_infer.config import MoeConfig
from mini_infer.factory.tokenizer import refresh_tokenizer_config, write_tokenizer
from mini_infer.paths import cache_dir

_QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen2.5-1.5B-Instruct's config: GQA of 12 query heads over 2 KV heads of 128, a tied LM head.
_QWEN25_15B = {
    **_QWEN25_05B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
}

# Qwen2.5-7B-Instruct's config: GQA of 28 query heads over 4 KV heads of 128, an untied LM head.
_QWEN25_7B = {
    **_QWEN25_05B,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}

# Configs in the published layout. "tiny" keeps the real vocabulary so the real tokenizer fits it.
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen2.5-1.5b": _QWEN25_15B,
    "qwen2.5-7b": _QWEN25_7B,
    "tiny": {
        **_QWEN25_05B,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "sliding_window": 4096,
    },
}

# Llama 3.2's config (1B/3B: tied head, rope_theta 5e5, llama3 RoPE scaling of 32 from 8,192 positions) at the tiny
# preset's size, with Qwen2.5's vocabulary and special token ids so that the Qwen tokenizer serves it.
PRESETS["llama3-tiny"] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 151936,
}

# Qwen3's dense config (no QKV bias, q_norm / k_norm, head_dim set apart from hidden_size / heads) at the tiny
# preset's size.
PRESETS["qwen3-tiny"] = {
    **{key: value for key, value in PRESETS["tiny"].items() if key not in ("sliding_window",)},
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 32,
    "model_type": "qwen3",
    "sliding_window": None,
}

# Qwen3-Embedding's shape at qwen3-tiny's size: a base model (Qwen3Model: no LM head, its tensors without the "model."
# prefix) with sentence-transformers' modules.json (SENTENCE_TRANSFORMERS below: last-token pooling, L2 normalised);
# its embeddings may be cut short (is_matryoshka), as Qwen3-Embedding's (MRL) may.
PRESETS["qwen3-embedding-tiny"] = {**PRESETS["qwen3-tiny"], "architectures": ["Qwen3Model"], "is_matryoshka": True}
# Qwen3-Reranker's shape at qwen3-tiny's size: a Qwen3 causal LM whose config.json carries the keys vLLM's
# hf_overrides give Qwen3-Reranker, so that the engine detects task score: the pair's score is
# sigmoid(logit(yes) - logit(no)) at its last token.
PRESETS["qwen3-reranker-tiny"] = {**PRESETS["qwen3-tiny"], "architectures": ["Qwen3ForSequenceClassification"],
                                  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}

# Qwen3-MoE's config (Qwen3's attention; every layer a mixture of top-8 of 128 experts of 768, renormalised) at
# qwen3-tiny's size: 8 experts, top 2.
PRESETS["qwen3-moe-tiny"] = {
    **PRESETS["qwen3-tiny"],
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
# Qwen3-30B-A3B's config: 48 layers of 32 query heads over 4 KV heads of 128, each token through 8 of 128 experts
# (30.5B parameters, 3.3B of them read per token).
PRESETS["qwen3-30b-a3b"] = {
    **PRESETS["qwen3-moe-tiny"],
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
# Qwen2-MoE's config (Qwen1.5-MoE-A2.7B: Qwen2's attention with its q/k/v biases, top-4 of 60 experts not
# renormalised, a shared expert gated by a sigmoid, an untied head) at the tiny preset's size.
PRESETS["qwen2-moe-tiny"] = {
    **PRESETS["tiny"],
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": False,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "output_router_logits": False,
    "qkv_bias": True,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 96,
    "tie_word_embeddings": False,
}

# sentence-transformers' files of the embedding presets: file -> content (modules.json, the Pooling module's config).
SENTENCE_TRANSFORMERS = {
    "modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ],
    "1_Pooling/config.json": {
        "word_embedding_dimension": PRESETS["qwen3-embedding-tiny"]["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True,
    },
}
EXTRA_FILES = {"qwen3-embedding-tiny": SENTENCE_TRANSFORMERS}

LAYOUTS = ("published", "transformers5")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Qwen2.5-0.5B-Instruct's generation_config.json.
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}

BIAS_STD = 0.02
# Weights are sampled and written one shard at a time, so a write holds at most one shard's tensors (or one tensor
# larger than a shard) in memory. 4 GB splits like the published checkpoints: Qwen2.5-7B-Instruct into four files,
# Qwen2.5-0.5B and 1.5B not at all (one model.safetensors, no index).
MAX_SHARD_BYTES = 4 * 10**9
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
NORM_STD = 0.1


def _write_json(path: Path, data: dict | list) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _transformers5_layout(config: dict) -> dict:
    converted = {key: value for key, value in config.items() if key not in ("rope_theta", "rope_scaling")}
    scaling = config.get("rope_scaling")
    if scaling is None:
        converted["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    else:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        converted["rope_parameters"] = {**scaling, "rope_type": rope_type, "rope_theta": config["rope_theta"]}
    converted["dtype"] = converted.pop("torch_dtype")
    if config["model_type"] == "qwen3_moe":  # transformers 5 names Qwen3-MoE's expert count so
        converted["num_local_experts"] = converted.pop("num_experts")
    if config["model_type"] in ("qwen2", "qwen3"):
        converted["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
        # transformers 5 drops the window size when sliding-window attention is off.
        if not config.get("use_sliding_window", False):
            converted["sliding_window"] = None
    return converted


def write_config(out_dir: str | os.PathLike, config: dict, layout: str = "published") -> None:
    """Write config.json from a published-layout config dict, in the given file layout.

    "published" matches released Qwen2.5 checkpoints (top-level rope_theta, torch_dtype);
    "transformers5" matches what transformers 5.x saves (rope_parameters, dtype, layer_types).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    data = config if layout == "published" else _transformers5_layout(config)
    _write_json(Path(out_dir) / "config.json", dict(sorted(data.items())))


def _mlp_shapes(config: dict, moe: MoeConfig | None, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP tensors: the dense SwiGLU, or a sparse layer's router, experts (and Qwen2-MoE's shared
    expert and its gate), each expert under its own names as the published checkpoints store them."""
    hidden, prefix = config["hidden_size"], f"model.layers.{layer}.mlp"
    if moe is None or not moe.sparse(layer):
        mlps, shapes = {prefix: config["intermediate_size"]}, {}
    else:
        mlps = {f"{prefix}.experts.{e}": moe.intermediate_size for e in range(moe.num_experts)}
        shapes = {f"{prefix}.gate.weight": (moe.num_experts, hidden)}
        if moe.shared_expert_intermediate_size:
            mlps[f"{prefix}.shared_expert"] = moe.shared_expert_intermediate_size
            shapes[f"{prefix}.shared_expert_gate.weight"] = (1, hidden)
    for name, inter in mlps.items():
        shapes |= {f"{name}.gate_proj.weight": (inter, hidden), f"{name}.up_proj.weight": (inter, hidden),
                   f"{name}.down_proj.weight": (hidden, inter)}
    return shapes


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Qwen2, Qwen3, Llama, Qwen2-MoE or Qwen3-MoE causal LM with this
    (published-layout) config (q/k/v biases: Qwen2's; q_norm / k_norm: Qwen3's); a base model's (architectures
    Qwen3Model, ...) without the LM head and the "model." prefix, as HF saves one."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    biased = config["model_type"] in ("qwen2", "qwen2_moe")
    moe = MoeConfig.from_dict(config, config["architectures"][0], "preset")  # which layers are sparse, and how
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        if biased:
            shapes |= {f"{prefix}.self_attn.{name}_proj.bias": (size,)
                       for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size))}
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            shapes |= {f"{prefix}.self_attn.{name}_norm.weight": (head_dim,) for name in ("q", "k")}
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (q_size, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_size),
            **_mlp_shapes(config, moe, i),
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    if config["architectures"][0].endswith("Model"):
        return {name.removeprefix("model."): shape for name, shape in shapes.items()}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def parameter_count(config: dict) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(config).values())


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one tensor's random stream: values do not depend on generation order, so tensors can be sampled
    in parallel, and a shape override leaves every other tensor unchanged (the GGUF writer's streams too)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def _tensor_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(tensor_seed(seed, name))


def _init_mean_std(name: str, config: dict) -> tuple[float, float]:
    if name.endswith("norm.weight"):
        return 1.0, NORM_STD
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    return 0.0, config["initializer_range"]


def random_weights(config: dict, seed: int, dtype: torch.dtype,
                   names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Deterministic random tensors (all of the model's, or those in `names`); biases and norm weights are perturbed
    too, so a loader that drops them (zeros, ones) produces visibly different outputs."""

    def sample(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        mean, std = _init_mean_std(name, config)
        # Sampled straight in the target dtype: no fp32 copy of any tensor is ever alive.
        return torch.empty(shape, dtype=dtype).normal_(mean, std, generator=_tensor_generator(seed, name))

    shapes = tensor_shapes(config)
    if names is not None:
        shapes = {name: shapes[name] for name in names}
    # torch's CPU sampler is single-threaded but releases the GIL, so threads scale with cores.
    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        tensors = pool.map(sample, shapes.keys(), shapes.values())
        return dict(zip(shapes.keys(), tensors))


def shard_plan(config: dict, dtype: torch.dtype, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """The tensor names of each weight file, in checkpoint order, each file at most max_shard_bytes (a tensor larger
    than that alone in its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in tensor_shapes(config).items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(out_dir: str | os.PathLike, config: dict, seed: int, dtype: torch.dtype,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write the random weights as model.safetensors, or, past max_shard_bytes, as HF's shards
    model-0000i-of-0000n.safetensors with model.safetensors.index.json; returns the weight files' names.

    Each shard is sampled, saved and dropped before the next one is sampled."""
    out_dir = Path(out_dir)
    plan = shard_plan(config, dtype, max_shard_bytes)
    files = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)])
    weight_map: dict[str, str] = {}
    total_size = 0
    for file, names in zip(files, plan):
        weights = random_weights(config, seed, dtype, names)
        save_file(weights, out_dir / file, metadata={"format": "pt"})
        (out_dir / file).chmod(0o644)  # safetensors creates it owner-only
        total_size += sum(tensor.nbytes for tensor in weights.values())
        weight_map |= dict.fromkeys(names, file)
        del weights  # up to a shard (4 GB): freed before the next one is sampled
    if len(files) > 1:
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    return files


def _check_out_dir_free(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"out_dir {out_dir} already exists and is not empty")


def _rename_into_place(staging: Path, out_dir: Path) -> None:
    try:
        os.rename(staging, out_dir)
    except OSError as error:
        # Raced with another writer that filled out_dir after our up-front check.
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise ValueError(f"out_dir {out_dir} already exists and is not empty") from error
        raise


def make_model(
    preset: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    layout: str = "published",
    overrides: dict | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a random-weight checkpoint (config, generation config, weights, tokenizer) to out_dir.

    The tokenizer is built from the `dashscope` package's Qwen2.5 vocabulary, or copied (tokenizer.json and
    tokenizer_config.json) from the directory `tokenizer_from` (a machine without that package: one model written
    elsewhere lends its tokenizer). Files are written to a temp dir beside out_dir and renamed into place, so out_dir
    either does not exist or holds a complete model. Weights past `max_shard_bytes` are split into HF's shards with
    an index (write_weights), sampled and written one shard at a time. (A GGUF file of a preset, written quantised
    straight: factory/gguf_writer.py make_gguf.)
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out_dir = Path(out_dir)
    _check_out_dir_free(out_dir)
    config = copy.deepcopy(PRESETS[preset]) | (overrides or {}) | {"torch_dtype": dtype}
    tokenizer_files = [Path(tokenizer_from) / name for name in TOKENIZER_FILES] if tokenizer_from else []
    missing = [str(path) for path in tokenizer_files if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer_from: {', '.join(missing)} not found")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        write_config(staging, config, layout)
        _write_json(staging / "generation_config.json", GENERATION_CONFIG)
        write_weights(staging, config, seed, DTYPES[dtype], max_shard_bytes)
        for name, content in EXTRA_FILES.get(preset, {}).items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            _write_json(staging / name, content)
        if tokenizer_files:
            for path in tokenizer_files:
                shutil.copyfile(path, staging / path.name)
        else:  # Qwen3's tokenizer (its thinking template) for the qwen3 model type
            write_tokenizer(staging, "qwen3" if config["model_type"].startswith("qwen3") else "qwen2.5")
        staging.chmod(0o755)  # mkdtemp creates it owner-only
        _rename_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def default_model_dir() -> Path:
    return cache_dir() / "models" / "qwen2.5-0.5b-random"


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def ensure_default_model(log: Callable[[str], None] = _print_to_stderr) -> Path:
    """The random-weight Qwen2.5-0.5B checkpoint in the cache, written on first use."""
    path = default_model_dir()
    # make_model renames a finished dir into place, so config.json means the model is complete.
    if (path / "config.json").is_file():
        if refresh_tokenizer_config(path):
            log(f"mini-infer: updated the chat template of {path} (it now renders tools)")
        return path
    log(f"mini-infer: writing a Qwen2.5-0.5B checkpoint with RANDOM weights to {path} (first use only)")
    try:
        make_model("qwen2.5-0.5b", path)
    except ValueError:
        # Another process finished writing it first.
        if not (path / "config.json").is_file():
            raise
    return path
