"""Random-weight GGUF files written straight in a quantised type: a model too large to write in bfloat16 first (the
Qwen3-30B-A3B shape: 61 GB of bfloat16, 18 GB as Q4_K_M) is written block by block, one tensor in memory at a time.

The file is what llama.cpp's convert_hf_to_gguf.py and then `llama-quantize ... Q4_K_M` would make of a checkpoint of
the preset's shape: the architecture's metadata keys, the Qwen tokenizer's vocabulary, merges and chat template, the
tensors under llama.cpp's names (a MoE layer's experts stacked, [experts, out, in]), norms, biases and routers in F32,
and each weight in the type Q4_K_M gives it (llama.cpp's llama_tensor_get_type): Q6_K for the LM head (and a tied
embedding) and for the value projection and the (experts') down projection of the layers `use_more_bits` picks (the
first and last eighth and every third between), Q4_K for every other weight and the embedding; a model of 8 experts
(Mixtral's count, which llama.cpp singles out) has its k and v in Q8_0 and its o in Q5_K. The blocks are random bytes
under scales chosen so that the weights spread as the safetensors presets' (std ~0.02 to 0.04): the cost of running
the file is a real file's, its outputs mean nothing.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from mini_infer.factory.checkpoint import NORM_STD, PRESETS, tensor_seed, tensor_shapes
from mini_infer.factory.tokenizer import cached_tokenizer_json, tokenizer_config
from mini_infer.gguf_file import BLOCK_BYTES, EXPERT_NAMES, GLOBAL_NAMES, GROUP, LAYER_NAMES, SUPER_BLOCK

FILE_TYPES = {"q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
# config.json's model_type -> general.architecture
_ARCHITECTURES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
_BLOCK_WEIGHTS = {"Q4_K": SUPER_BLOCK, "Q5_K": SUPER_BLOCK, "Q6_K": SUPER_BLOCK, "Q8_0": GROUP}
# HF's names -> llama.cpp's (the GGUF loader's tables, inverted)
_GLOBAL = {hf: name for name, hf in GLOBAL_NAMES.items()}
_LAYER = {hf: name for name, hf in LAYER_NAMES.items()}
_EXPERTS = {hf: name for name, hf in EXPERT_NAMES.items()}
_ROUTER_STD = 0.02
# llama.cpp's token types
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose v and down projections Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_tensors(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp name, shape [outer ... inner], type) of each tensor of a Q4_K_M file of this (published-layout)
    config: the checkpoint's tensors (factory/checkpoint.py tensor_shapes) renamed, experts stacked."""
    layers = config["num_hidden_layers"]
    eight_experts = config.get("num_experts") == 8  # (Mixtral's count) k, v in Q8_0 and o in Q5_K, as llama.cpp's
    tensors = []
    for name, shape in tensor_shapes(config).items():
        if name in _GLOBAL:
            gguf = _GLOBAL[name]
            head = gguf == "output.weight" or (gguf == "token_embd.weight" and config["tie_word_embeddings"])
            tensors.append((gguf, shape, "F32" if len(shape) == 1 else "Q6_K" if head else "Q4_K"))
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if module.startswith("mlp.experts."):
            expert, projection = module.removeprefix("mlp.experts.").split(".")
            if expert != "0":
                continue  # stacked with expert 0's
            gguf, experts = f"blk.{layer}.{_EXPERTS[projection]}.{suffix}", config["num_experts"]
            shape = (experts, *shape)
        else:
            gguf = f"blk.{layer}.{_LAYER[module]}.{suffix}"
        if suffix == "bias" or len(shape) == 1 or module in ("mlp.gate", "mlp.shared_expert_gate"):
            kind = "F32"
        elif eight_experts and module.endswith(("k_proj", "v_proj")):
            kind = "Q8_0"
        elif eight_experts and module.endswith("o_proj"):
            kind = "Q5_K"
        elif module.endswith(("v_proj", "down_proj")) and use_more_bits(int(layer), layers):
            kind = "Q6_K"
        else:
            kind = "Q4_K"
        if module == "mlp.shared_expert_gate":
            shape = shape[1:]  # llama.cpp's vector, HF's one row
        tensors.append((gguf, shape, kind))
    for name, shape, kind in tensors:
        if kind != "F32" and shape[-1] % _BLOCK_WEIGHTS[kind]:
            raise ValueError(f"{name}: {kind} needs rows of a multiple of {_BLOCK_WEIGHTS[kind]} weights, the "
                             f"preset's are {shape[-1]}")
    return tensors


def _halves(values: np.ndarray) -> np.ndarray:
    """float values -> their float16 bytes, [n, 2] uint8."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(kind: str, weights: int, rng: np.random.Generator) -> np.ndarray:
    """`weights` / block size random blocks of `kind`, [blocks, block bytes] uint8: random bytes, their float16 d
    (and dmin) set so that a block's weights spread by ~0.02 (and its sub-blocks' offsets by ~0.03). Q4_K and Q5_K
    (d, dmin, 12 bytes of 6-bit scales and mins, Q5_K's 32 bytes of high bits, 128 bytes of low 4 bits; w = d sc q -
    dmin m, sc and m in 0..63): q spreads by 4.6 (Q4_K) or 9.2 (Q5_K). Q6_K (128 bytes of q's low 4 bits, 64 of its
    high 2, 16 int8 scales, d; w = d sc (q - 32)): |sc| ~64, q - 32 spreads by 18.5. Q8_0 (d, 32 int8 q; w = d q): q
    spreads by 74."""
    blocks = weights // _BLOCK_WEIGHTS[kind]
    data = np.frombuffer(bytearray(rng.bytes(blocks * BLOCK_BYTES[kind])), np.uint8).reshape(blocks, -1)
    scale = rng.uniform(0.5, 1.5, blocks)
    if kind in ("Q4_K", "Q5_K"):
        data[:, 0:2] = _halves((1.4e-4 if kind == "Q4_K" else 7e-5) * scale)
        data[:, 2:4] = _halves(1.0e-3 * scale)
    elif kind == "Q6_K":
        data[:, 208:210] = _halves(1.7e-5 * scale)
    else:
        data[:, 0:2] = _halves(2.7e-4 * scale)
    return data


def _float_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (1.0 + NORM_STD * rng.standard_normal(shape)).astype(np.float32)
    return (_ROUTER_STD * rng.standard_normal(shape)).astype(np.float32)  # biases and routers


def _tokenizer_metadata(writer, config: dict, family: str) -> None:
    """The Qwen tokenizer as llama.cpp's GPT-2-style BPE vocabulary: tokens in id order (the byte-level strings of
    tokenizer.json), padded to the embedding's rows with unused [PADn] tokens, their types, the merges, the special
    ids and the chat template."""
    spec = json.loads(cached_tokenizer_json(family).read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    added = {token["id"]: token for token in spec["added_tokens"]}
    size = config["vocab_size"]
    tokens, types = [f"[PAD{i}]" for i in range(size)], [_UNUSED] * size
    for token, i in vocab.items():
        tokens[i], types[i] = token, _NORMAL
    for i, token in added.items():
        tokens[i], types[i] = token["content"], _CONTROL if token["special"] else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    template = tokenizer_config(family)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {token["content"]: i for i, token in added.items()}  # both are added (special) tokens
    writer.add_eos_token_id(ids[template["eos_token"]])
    writer.add_pad_token_id(ids[template["pad_token"]])
    writer.add_bos_token_id(ids[template["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(template["chat_template"])


def write_gguf(config: dict, out: Path, file_type: str, seed: int) -> None:
    """Write the random-weight file of `config` (a preset's published-layout config.json) to `out` in `file_type`
    (FILE_TYPES), staged beside it and renamed into place."""
    import gguf

    if file_type not in FILE_TYPES:
        raise ValueError(f"gguf file type must be one of {sorted(FILE_TYPES)}, got {file_type!r}")
    model_type = config["model_type"]
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"a GGUF file is written for model types {sorted(_ARCHITECTURES)}, not {model_type!r}")
    arch = _ARCHITECTURES[model_type]
    tensors = gguf_tensors(config)
    fd, staging = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(staging, arch)
        writer.add_name(f"mini-infer random {arch}")
        writer.add_file_type(FILE_TYPES[file_type])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(config["rope_theta"])
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        if model_type.endswith("moe"):
            writer.add_expert_count(config["num_experts"])
            writer.add_expert_used_count(config["num_experts_per_tok"])
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
            if config.get("shared_expert_intermediate_size"):
                writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        _tokenizer_metadata(writer, config, "qwen3" if model_type.startswith("qwen3") else "qwen2.5")
        for name, shape, kind in tensors:
            weights = int(np.prod(shape))
            if kind == "F32":
                writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * weights)
            else:
                row_bytes = shape[-1] // _BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind]
                writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                                       weights // _BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind],
                                       raw_dtype=gguf.GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, kind in tensors:
            rng = np.random.default_rng(tensor_seed(seed, name))
            writer.write_tensor_data(_float_tensor(name, shape, rng) if kind == "F32" else
                                     random_blocks(kind, int(np.prod(shape)), rng))
        writer.close()
        os.chmod(staging, 0o644)  # mkstemp creates it owner-only
        os.replace(staging, out)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def make_gguf(preset: str, out: str | os.PathLike, file_type: str, *, seed: int = 0,
              overrides: dict | None = None) -> Path:
    """`make-model --gguf`: the preset (factory/checkpoint.py PRESETS, with `overrides`) as one random-weight GGUF
    file of `file_type` at `out`."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(copy.deepcopy(PRESETS[preset]) | (overrides or {}), out, file_type, seed)
    return out
