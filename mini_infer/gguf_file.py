"""A GGUF file (llama.cpp's format) as a model directory.

`LLM("model.gguf")` runs the directory the file stands for, written once into the cache (`gguf/<name>-<key>/`, the key
a hash of the file's path, size and time and of the tokenizer asked for): config.json from the file's metadata (the
architecture's shape keys, as llama.cpp's convert_hf_to_gguf.py writes them from config.json), generation_config.json
(its eos/bos ids and the general.sampling defaults), the tokenizer (the files of the `tokenizer` directory given, or
the file's own vocabulary converted by transformers, as vLLM does), and `model.gguf`, a link to the file, whose tensors
model/gguf_weights.py loads. Everything else reads that directory as it reads any checkpoint's.

The tensors' types are checked here, before anything loads: F32, F16 and BF16 load as they are, Q8_0 and Q4_0 into
mini-infer's int8 and int4 layouts unchanged (groups of 32, a float16 scale each); any other type is refused with the
tensor's name. A file with quantised projections is a pre-quantised checkpoint (quantization_config "gguf"): it runs on
the native kernels, in one tensor-parallel rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from mini_infer.paths import cache_dir

# general.architecture -> config.json's architectures
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = {"Q8_0": 8, "Q4_0": 4}  # type -> bits, groups of 32 (QK8_0 = QK4_0 = 32)
GROUP = 32
LINK = "model.gguf"  # the link to the file in its model directory
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty"}  # general.sampling.* -> generation_config.json
_LAYOUT_VERSION = 1  # of the directory written: a change writes it again


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def model_dir(path: str | Path, tokenizer: str | Path | None = None) -> Path:
    """The model directory for the GGUF file at `path` (written on first use), with the tokenizer of the directory
    `tokenizer` (None: the file's own)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    tokenizer_dir = Path(tokenizer).resolve() if tokenizer is not None else None
    if tokenizer_dir is not None and not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json in {tokenizer}")
    stat = file.stat()
    key = hashlib.sha256(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\0{tokenizer_dir}\0{_LAYOUT_VERSION}".encode())
    out = cache_dir() / "gguf" / f"{file.stem}-{key.hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write(file, tokenizer_dir, staging)
        try:
            staging.rename(out)  # atomic: a concurrent writer's directory, if it came first, is as good
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write(file: Path, tokenizer_dir: Path | None, out: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(file)
    config, generation = hf_config(reader, str(file))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    os.symlink(file, out / LINK)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out / name)
    elif "tokenizer.ggml.tokens" in reader.fields:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name).save_pretrained(str(out))


def field(reader, key: str, default=None):
    """A metadata value (strings decoded, arrays as lists), or `default` when the file has none."""
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-06, not 9.999999974752427e-07): the
    config.json value it was written from."""
    import numpy as np

    return float(str(np.float32(value)))


def hf_config(reader, source: str) -> tuple[dict, dict]:
    """config.json and generation_config.json for the file's model; its tensors' types checked (module docstring)."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: general.architecture {arch!r} is not supported; mini-infer loads GGUF files of "
                         f"{', '.join(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{source}: no token_embd.weight tensor")
    kinds = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in FLOAT_TYPES and kind not in QUANTIZED_TYPES:
            raise ValueError(f"{source}: tensor {tensor.name!r} is {kind}; mini-infer loads GGUF tensors of types "
                             f"{', '.join((*FLOAT_TYPES, *QUANTIZED_TYPES))}")
        if kind in QUANTIZED_TYPES and not tensor.name.endswith(".weight"):
            raise ValueError(f"{source}: tensor {tensor.name!r} is {kind}; only weights may be quantised")
        kinds.add(kind)
    p = f"{arch}."

    def need(key: str):
        value = field(reader, p + key)
        if value is None:
            raise ValueError(f"{source}: metadata {p + key} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    embedding = tensors["token_embd.weight"]
    # The embedding's dtype where it is float; a quantised file's activations run in bfloat16 (the native kernels
    # take bfloat16 or float32 activations; llama.cpp's are float32, its KV cache float16).
    dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(embedding.tensor_type.name, "bfloat16")
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(field(reader, p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")), "vocab_size": int(embedding.shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": dtype,
    }
    if "rope_freqs.weight" in tensors:  # Llama 3.1's scaled RoPE, as llama.cpp takes it: a factor per frequency
        freqs = tensors["rope_freqs.weight"]
        if freqs.tensor_type.name != "F32":
            raise ValueError(f"{source}: rope_freqs.weight is {freqs.tensor_type.name}, expected F32")
        config["rope_freq_factors"] = [float(f) for f in freqs.data]
    quantized = sorted(kinds & set(QUANTIZED_TYPES))
    if quantized:
        config["quantization_config"] = {"quant_method": "gguf", "bits": min(QUANTIZED_TYPES[k] for k in quantized),
                                         "group_size": GROUP, "gguf_types": quantized}
    generation = {}
    for name in ("bos", "eos"):
        token = field(reader, f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[f"{name}_token_id"] = generation[f"{name}_token_id"] = int(token)
    for key, name in _SAMPLING.items():
        value = field(reader, f"general.sampling.{key}")
        if value is not None:
            generation[name] = int(value) if name == "top_k" else _float32(value)
    return config, generation
