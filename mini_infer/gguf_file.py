"""A GGUF file (llama.cpp's format) as a model directory.

`LLM("model.gguf")` runs the directory the file stands for, written once into the cache (`gguf/<name>-<key>/`, the key
a hash of the file's path, size and time and of the tokenizer asked for): config.json from the file's metadata (the
architecture's shape keys, as llama.cpp's convert_hf_to_gguf.py writes them from config.json), generation_config.json
(its eos/bos ids and the general.sampling defaults), the tokenizer (the files of the `tokenizer` directory given, or
the file's own vocabulary converted by transformers, as vLLM does), and `model.gguf`, a link to the file, whose tensors
model/gguf_weights.py loads. Everything else reads that directory as it reads any checkpoint's. The file is read by
GGUFHeader, in one pass, with gguf-py's constants.

The tensors' types are checked here, before anything loads: F32, F16 and BF16 load as they are, Q8_0 and Q4_0 into
mini-infer's int8 and int4 layouts unchanged (groups of 32, a float16 scale each), the K-quants Q4_K, Q5_K and Q6_K
into the same kernels' two-level layout with their integers and scales unchanged (model/gguf_weights.py); any other
type is refused with the tensor's name. A file with quantised projections is a pre-quantised checkpoint
(quantization_config "gguf"): it runs on the native kernels, in one tensor-parallel rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mini_infer.paths import cache_dir

# general.architecture -> config.json's architectures
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
FLOAT_TYPES = ("F32", "F16", "BF16")
# type -> the bits of the int8 / int6 / int4 layout it loads into (model/gguf_weights.py): Q8_0 and Q4_0 as they
# are, the K-quants Q4_K (4-bit q, a scale and a min per 32), Q5_K (5-bit q, the same) and Q6_K (6-bit q, a scale per
# 16) with their two levels of scales
QUANTIZED_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q5_K": 8, "Q6_K": 6}
GROUP = 32
LINK = "model.gguf"  # the link to the file in its model directory
# llama.cpp's tensor names -> HF's (model/gguf_weights.py loads by them, factory/gguf_writer.py writes by them)
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
               "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
               "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # [E, out, in]
# a block's bytes, by type
BLOCK_BYTES = {"Q8_0": 2 + GROUP, "Q4_0": 2 + GROUP // 2, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SUPER_BLOCK = 256  # the K-quants' weights per block (QK_K)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "penalty_repeat": "repetition_penalty"}  # general.sampling.* -> generation_config.json
_LAYOUT_VERSION = 1  # of the directory written: a change writes it again


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor of the file: its name, GGML type, dimensions innermost first (GGUF's order) and bytes."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    bytes: object  # a read-only numpy uint8 view of the file

    @property
    def data(self):
        """As gguf-py's reader gives it: a float tensor's values [outer ..., innermost], a quantised one's blocks
        [outer ..., bytes of a row]."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.tensor_type]
        rows = [int(n) for n in reversed(self.shape[1:])]
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(self.tensor_type.name)
        if dtype is not None:
            return self.bytes.view(dtype).reshape(*rows, self.shape[0])
        return self.bytes.reshape(*rows, self.shape[0] // block * size)


class GGUFHeader:
    """A GGUF file's metadata and tensor table, read in one pass (gguf-py's GGUFReader builds numpy parts for every
    string of the vocabulary: 13 s for Qwen's 151,936 tokens and 294,166 merges on a Zen 3, against well under one
    here), and its tensors' bytes mapped from the file. The format's constants are gguf-py's."""

    def __init__(self, path: str | Path) -> None:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

        self.path = str(path)
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        view = memoryview(raw)
        magic, version, tensor_count, kv_count = struct.unpack_from("<IIQQ", view, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (or a big-endian one, which is not read)")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
        self._view, offset = view, 24
        self.fields: dict[str, object] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,), offset = struct.unpack_from("<I", view, offset), offset + 4
            self.fields[key], offset = self._value(kind, offset)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims,) = struct.unpack_from("<I", view, offset)
            shape = struct.unpack_from(f"<{dims}Q", view, offset + 4)
            kind, start = struct.unpack_from("<IQ", view, offset + 4 + 8 * dims)
            offset += 4 + 8 * dims + 12
            infos.append((name, GGMLQuantizationType(kind), tuple(int(n) for n in shape), start))
        alignment = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data = -(-offset // alignment) * alignment
        self.tensors = []
        for name, kind, shape, start in infos:
            block, size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape))
            nbytes = count // block * size
            self.tensors.append(Tensor(name, kind, shape, raw[data + start: data + start + nbytes]))
        del self._view

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._view, offset)
        return bytes(self._view[offset + 8: offset + 8 + length]).decode("utf-8", errors="replace"), offset + 8 + length

    def _value(self, kind: int, offset: int) -> tuple[object, int]:
        if kind == _STRING:
            return self._string(offset)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", self._view, offset)
            offset += 12
            if item in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[item]
                values = struct.unpack_from(f"<{count}{fmt[1]}", self._view, offset)
                return list(values), offset + count * struct.calcsize(fmt)
            values = []
            for _ in range(count):
                value, offset = self._value(item, offset)
                values.append(value)
            return values, offset
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"{self.path}: metadata value of unknown type {kind}")
        return struct.unpack_from(fmt, self._view, offset)[0], offset + struct.calcsize(fmt)


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def model_dir(path: str | Path, tokenizer: str | Path | None = None) -> Path:
    """The model directory for the GGUF file at `path` (written on first use), with the tokenizer of the directory
    `tokenizer` (None: the file's own)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    tokenizer_dir = Path(tokenizer).resolve() if tokenizer is not None else None
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
    header = GGUFHeader(file)
    config, generation = hf_config(header, str(file))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    os.symlink(file, out / LINK)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out / name)
    elif "tokenizer.ggml.tokens" in header.fields:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name).save_pretrained(str(out))


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-06, not 9.999999974752427e-07): the
    config.json value it was written from."""
    import numpy as np

    return float(str(np.float32(value)))


def hf_config(header: GGUFHeader, source: str) -> tuple[dict, dict]:
    """config.json and generation_config.json for the file's model; its tensors' types checked (module docstring)."""
    meta = header.fields
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: general.architecture {arch!r} is not supported; mini-infer loads GGUF files of "
                         f"{', '.join(ARCHITECTURES)}")
    tensors = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{source}: no token_embd.weight tensor")
    kinds = set()
    for tensor in header.tensors:
        kind = tensor.tensor_type.name
        if kind not in FLOAT_TYPES and kind not in QUANTIZED_TYPES:
            raise ValueError(f"{source}: tensor {tensor.name!r} is {kind}; mini-infer loads GGUF tensors of types "
                             f"{', '.join((*FLOAT_TYPES, *QUANTIZED_TYPES))}")
        if kind in QUANTIZED_TYPES and not tensor.name.endswith(".weight"):
            raise ValueError(f"{source}: tensor {tensor.name!r} is {kind}; only weights may be quantised")
        kinds.add(kind)
    p = f"{arch}."

    def need(key: str):
        value = meta.get(p + key)
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
        "num_attention_heads": heads, "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")), "vocab_size": int(embedding.shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors, "torch_dtype": dtype,
    }
    if arch.endswith("moe"):
        # A layer without a router keeps its dense MLP (llama.cpp's own build expects experts in every layer); the
        # top-k weights renormalised for Qwen3-MoE and not for Qwen2-MoE (as llama.cpp computes them) unless the
        # file says otherwise.
        dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        config |= {"num_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
                   "moe_intermediate_size": int(need("expert_feed_forward_length")),
                   "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", arch == "qwen3moe")),
                   "decoder_sparse_step": 1, "mlp_only_layers": dense}
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = int(need("expert_shared_feed_forward_length"))
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
        token = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[f"{name}_token_id"] = generation[f"{name}_token_id"] = int(token)
    for key, name in _SAMPLING.items():
        value = meta.get(f"general.sampling.{key}")
        if value is not None:
            generation[name] = int(value) if name == "top_k" else _float32(value)
    return config, generation
