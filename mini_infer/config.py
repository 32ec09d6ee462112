"""Configuration: the model's shape read from a checkpoint's config.json, and every engine knob.

Both are validated once, here, so the rest of the engine can trust them.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mini_infer import gguf_file
from mini_infer.speculative_config import SpeculativeConfig

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}
# config.json's architectures that load, on one decoder with switches (ModelConfig.attention_bias, qk_norm,
# rope_scaling): Qwen2 (Qwen2.5) with its QKV bias; Qwen3 (dense) without, with an RMSNorm on each head of q and k;
# Llama (3, 3.1, 3.2) without either, its head tied or not, RoPE plain or "llama3".
# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B: Qwen2's attention, shared experts) and Qwen3-MoE (Qwen3's attention) swap
# the MLP of their sparse layers for a mixture of experts (ModelConfig.moe).
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM")
_QWEN3_ATTENTION = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # q_norm / k_norm, no QKV bias
# The same decoders saved as base models, without an LM head (their tensors may lack the "model." prefix, as a
# sentence-transformers checkpoint's do): embedding models, task embed.
BASE_MODEL_ARCHITECTURES = {"Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                            "LlamaModel": "LlamaForCausalLM"}
# Qwen3-Reranker as vLLM loads it (hf_overrides {"architectures": [this], "classifier_from_token": ["no", "yes"],
# "is_original_qwen3_reranker": true}, or the same keys in config.json): a Qwen3ForCausalLM checkpoint whose score is
# sigmoid(logit(yes) - logit(no)) at a prompt's last token, task score.
RERANKER_ARCHITECTURE = "Qwen3ForSequenceClassification"
# What an engine computes: text (generate), embeddings (embed) or a reranker's scores (score); auto: detected from the
# checkpoint as vLLM detects a pooling model (resolve_task; docs/decisions/019-pooling.md).
TASKS = ("auto", "generate", "embed", "score")
POOLING_TYPES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}  # sentence-transformers' modes


# pre-quantised checkpoints' methods (mini_infer.model.prequantized; GGUF's Q8_0 / Q4_0: mini_infer.gguf_file)
CHECKPOINT_QUANTIZATION = ("gptq", "awq", "gguf")
# Methods and formats people meet that mini-infer does not load, each with what it is.
_UNSUPPORTED_METHODS = {
    "exl2": "exllama v2's EXL2 format", "marlin": "Marlin's packing", "gptq_marlin": "Marlin's packing",
    "awq_marlin": "Marlin's packing", "bitblas": "BitBLAS's packing", "bitsandbytes": "bitsandbytes",
    "fp8": "FP8 weights", "compressed-tensors": "compressed-tensors", "hqq": "HQQ", "aqlm": "AQLM", "eetq": "EETQ",
    "torchao": "torchao's tensor subclasses", "qqq": "QQQ", "mxfp4": "MXFP4"}
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 2}  # checkpoint_format -> its zero-point convention (v1 stores zero - 1)
_AWQ_UNSUPPORTED_VERSIONS = {"gemv": "GEMV packing", "gemv_fast": "GEMV-fast packing", "marlin": "Marlin's packing",
                             "exllama": "ExLlama's packing", "ipex": "IPEX's packing"}


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """A pre-quantised checkpoint's `quantization_config`: GPTQ (bits 4 or 8, groups or one per row, symmetric or
    not for 4 bits, act-order with g_idx), AWQ (4 bits, GEMM packing, zero points), or a GGUF file's (the directory
    gguf_file.py writes for it: its fewest bits, groups of 32; each tensor's own type says how it loads)."""

    method: str  # CHECKPOINT_QUANTIZATION
    bits: int
    group_size: int  # inputs per scale; -1: one scale per output channel
    desc_act: bool = False  # GPTQ's act-order: g_idx maps each input to its group
    zero_offset: int = 0  # what GPTQ v1 checkpoints store their zero points less by (1), else 0

    @classmethod
    def from_dict(cls, raw: object, source: str) -> CheckpointQuantization:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: quantization_config must be an object, got {raw!r}")
        method = str(raw.get("quant_method", "")).lower()
        where = f"{source}: quantization_config"
        if method in _UNSUPPORTED_METHODS:
            raise ValueError(f"{where} quant_method {method!r} ({_UNSUPPORTED_METHODS[method]}) is not supported; "
                             f"mini-infer loads {' and '.join(CHECKPOINT_QUANTIZATION)} checkpoints")
        if method not in CHECKPOINT_QUANTIZATION:
            raise ValueError(f"{where} quant_method must be one of {', '.join(CHECKPOINT_QUANTIZATION)}, got "
                             f"{raw.get('quant_method')!r}")
        if method == "gguf":
            return cls("gguf", int(raw["bits"]), int(raw["group_size"]))
        bits, group = raw.get("bits", raw.get("w_bit")), raw.get("group_size", raw.get("q_group_size"))
        allowed_bits = (4, 8) if method == "gptq" else (4,)
        if bits not in allowed_bits:
            raise ValueError(f"{where} bits must be one of {', '.join(map(str, allowed_bits))} for {method}, got "
                             f"{bits!r}")
        if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
            raise ValueError(f"{where} group_size must be -1 or a positive multiple of 8, got {group!r}")
        if raw.get("lm_head"):
            raise ValueError(f"{where} lm_head true (a quantised LM head) is not supported")
        if method == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version in _AWQ_UNSUPPORTED_VERSIONS:
                raise ValueError(f"{where} version {version!r} ({_AWQ_UNSUPPORTED_VERSIONS[version]}) is not "
                                 "supported; mini-infer loads AWQ's GEMM packing (version 'gemm')")
            if version != "gemm":
                raise ValueError(f"{where} version must be 'gemm', got {raw.get('version')!r}")
            if raw.get("zero_point", True) is not True:
                raise ValueError(f"{where} zero_point must be true for AWQ (GEMM packing stores zero points), got "
                                 f"{raw.get('zero_point')!r}")
            if raw.get("modules_to_not_convert"):
                raise ValueError(f"{where} modules_to_not_convert {raw['modules_to_not_convert']!r}: checkpoints "
                                 "with some projections left unquantised are not supported")
            return cls("awq", bits, group)
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if raw.get("is_marlin_format") or fmt not in _GPTQ_FORMATS:
            name = "marlin" if raw.get("is_marlin_format") else fmt
            raise ValueError(f"{where} checkpoint_format {name!r}"
                             f"{f' ({_UNSUPPORTED_METHODS[name]})' if name in _UNSUPPORTED_METHODS else ''} is not "
                             f"supported; mini-infer loads {' and '.join(map(repr, _GPTQ_FORMATS))}")
        sym = raw.get("sym", True)
        if bits == 8 and sym is not True:
            raise ValueError(f"{where} sym {sym!r} with 8 bits (zero points on int8 weights) is not supported; "
                             "8-bit GPTQ checkpoints load with sym true")
        if raw.get("dynamic"):
            raise ValueError(f"{where} dynamic (per-module bits or group sizes) is not supported")
        desc_act = raw.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise ValueError(f"{where} desc_act must be true or false, got {desc_act!r}")
        return cls("gptq", bits, group, desc_act, 1 if _GPTQ_FORMATS[fmt] == 1 else 0)


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """RoPE frequencies of rope_type "llama3" (Llama 3.1 / 3.2): wavelengths longer than the original context over
    low_freq_factor are slowed by `factor`, shorter than it over high_freq_factor kept, those between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_dict(cls, raw: dict, source: str) -> Llama3RopeScaling:
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [name for name in fields if not isinstance(raw.get(name), (int, float)) or isinstance(
            raw.get(name), bool)]
        if missing:
            raise ValueError(f"{source}: rope type 'llama3' needs numbers {', '.join(missing)}")
        scaling = cls(float(raw["factor"]), float(raw["low_freq_factor"]), float(raw["high_freq_factor"]),
                      int(raw["original_max_position_embeddings"]))
        if not (scaling.factor > 0 and 0 < scaling.low_freq_factor < scaling.high_freq_factor
                and scaling.original_max_position_embeddings > 0):
            raise ValueError(f"{source}: rope type 'llama3' needs factor > 0, 0 < low_freq_factor < "
                             f"high_freq_factor and original_max_position_embeddings > 0, got {raw}")
        return scaling


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE): each token's router logits [num_experts] go through a softmax
    in float32, its top_k experts' SwiGLU MLPs (moe_intermediate_size each) run on it and their outputs are summed
    weighted by those probabilities (renormalised over the top_k where norm_topk_prob); Qwen2-MoE adds a shared
    expert (shared_expert_intermediate_size) gated by sigmoid(shared_expert_gate . x). Layer i is sparse unless it
    is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step; the others keep the dense MLP
    (intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE)

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, raw: dict, architecture: str, source: str) -> MoeConfig | None:
        """None for a dense architecture."""
        if "Moe" not in architecture:
            return None
        experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 saves Qwen3-MoE's as the latter

        def positive(key: str, value) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{source}: {key} must be an integer >= 1, got {value!r}")
            return value

        experts = positive("num_experts", experts)
        top_k = positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
        if top_k > experts:
            raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={experts}")
        only = raw.get("mlp_only_layers") or []
        if not (isinstance(only, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in only)):
            raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
        shared = 0
        if architecture == "Qwen2MoeForCausalLM":
            shared = positive("shared_expert_intermediate_size", raw.get("shared_expert_intermediate_size"))
        return cls(experts, top_k, positive("moe_intermediate_size", raw.get("moe_intermediate_size")),
                   _flag(raw, "norm_topk_prob", source), positive("decoder_sparse_step",
                                                                   raw.get("decoder_sparse_step", 1)),
                   tuple(sorted(set(only))), shared)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's shape and switches, as the checkpoint's config.json describes them (SUPPORTED_ARCHITECTURES)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...] = ()
    quantization: CheckpointQuantization | None = None  # a pre-quantised (GPTQ, AWQ) checkpoint's
    architecture: str = "Qwen2ForCausalLM"
    attention_bias: bool = True  # q/k/v projections with a bias: Qwen2's (Qwen3 and Llama have none)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3)
    rope_scaling: Llama3RopeScaling | None = None
    # A GGUF file's rope_freqs (llama.cpp's form of Llama 3.1's RoPE scaling): each rotary frequency over its factor.
    rope_freq_factors: tuple[float, ...] | None = None
    classifier_from_token: tuple[str, ...] | None = None  # a reranker's (no, yes) tokens (RERANKER_ARCHITECTURE)
    # Embeddings that may be cut short (PoolingParams.dimensions): any length (is_matryoshka) or these lengths.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    moe: MoeConfig | None = None  # the mixture of experts of a MoE architecture's sparse layers

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe.sparse(layer)

    @property
    def decode_weights(self) -> int:
        """The weights a decode step of one token reads: every layer's projections (a sparse layer's router, its
        top_k experts and its shared expert) and the LM head (not the embedding)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention, hidden = self.hidden_size * (2 * q + 2 * kv), self.hidden_size
        moe = self.moe
        total = self.vocab_size * hidden
        for layer in range(self.num_hidden_layers):
            if self.sparse(layer):
                shared = moe.shared_expert_intermediate_size
                experts = 3 * hidden * moe.intermediate_size * moe.top_k + 3 * hidden * shared
                total += attention + moe.num_experts * hidden + experts + (hidden if shared else 0)
            else:
                total += attention + 3 * hidden * self.intermediate_size
        return total

    @classmethod
    def from_dir(cls, model_dir: str | Path, overrides: dict | None = None) -> ModelConfig:
        """config.json, with `overrides` (vLLM's hf_overrides) laid over its top-level keys."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        raw = _read_json(path)
        if overrides is not None:
            if not isinstance(overrides, dict):
                raise ValueError(f"hf_overrides must be a JSON object (a dict), got {overrides!r}")
            raw = {**raw, **overrides}
        return cls.from_dict(raw, source=str(path) + (" with hf_overrides" if overrides else ""))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        known = (*SUPPORTED_ARCHITECTURES, *BASE_MODEL_ARCHITECTURES, RERANKER_ARCHITECTURE)
        architecture = next((a for a in archs if a in known), None)
        if architecture is None:
            raise ValueError(
                f"{source}: architectures {archs!r} (model_type {raw.get('model_type')!r}) is not supported; "
                f"mini-infer runs {', '.join(SUPPORTED_ARCHITECTURES)} (embeddings: "
                f"{', '.join(BASE_MODEL_ARCHITECTURES)} or any of those with sentence-transformers pooling; rerank: "
                f"{RERANKER_ARCHITECTURE} in the Qwen3-Reranker form)"
            )
        # The decoder the checkpoint holds, whatever head it is saved with.
        family = ("Qwen3ForCausalLM" if architecture == RERANKER_ARCHITECTURE
                  else BASE_MODEL_ARCHITECTURES.get(architecture, architecture))
        _reject_unsupported_attention(raw, source)
        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias true (biases on the MLP projections) is not supported")
        qwen2_attention = family in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        if not qwen2_attention and raw.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias true ({architecture}'s biases on q/k/v and o_proj) is not "
                             "supported")
        if family == "Qwen2MoeForCausalLM" and raw.get("qkv_bias") is False:
            raise ValueError(f"{source}: qkv_bias false (Qwen2-MoE without its q/k/v biases) is not supported")
        attention_bias = qwen2_attention
        quantized = raw.get("quantization_config")
        quantization = CheckpointQuantization.from_dict(quantized, source) if quantized else None

        def need(key: str):
            if key not in raw:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        head_dim = int(raw.get("head_dim") or hidden // heads)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, source),
            rope_scaling=_rope_scaling(raw, source),
            rope_freq_factors=_rope_freq_factors(raw, head_dim, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(need("max_position_embeddings")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            quantization=quantization,
            architecture=architecture,
            attention_bias=attention_bias,
            qk_norm=family in _QWEN3_ATTENTION,
            classifier_from_token=_reranker_tokens(raw, architecture, source),
            is_matryoshka=_flag(raw, "is_matryoshka", source),
            matryoshka_dimensions=_matryoshka_dimensions(raw, hidden, source),
            moe=MoeConfig.from_dict(raw, family, source),
        )


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _flag(raw: dict, key: str, source: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _reranker_tokens(raw: dict, architecture: str, source: str) -> tuple[str, ...] | None:
    """The (no, yes) tokens of a Qwen3-Reranker (RERANKER_ARCHITECTURE); None for other architectures."""
    if architecture != RERANKER_ARCHITECTURE:
        return None
    tokens = raw.get("classifier_from_token")
    if not (_flag(raw, "is_original_qwen3_reranker", source) and isinstance(tokens, list) and len(tokens) == 2
            and all(isinstance(t, str) and t for t in tokens)):
        raise ValueError(f"{source}: {architecture} runs in the Qwen3-Reranker form only (vLLM's hf_overrides): "
                         "is_original_qwen3_reranker true and classifier_from_token the two tokens [no, yes] whose "
                         f"LM-head logits score a pair; got is_original_qwen3_reranker "
                         f"{raw.get('is_original_qwen3_reranker')!r}, classifier_from_token {tokens!r}")
    return tuple(tokens)


def _matryoshka_dimensions(raw: dict, hidden: int, source: str) -> tuple[int, ...] | None:
    dims = raw.get("matryoshka_dimensions")
    if dims is None:
        return None
    if not (isinstance(dims, list) and dims and all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= hidden
                                                    for d in dims)):
        raise ValueError(f"{source}: matryoshka_dimensions must be a non-empty list of integers in [1, {hidden}] "
                         f"(hidden_size), got {dims!r}")
    return tuple(dims)


_ROPE_TYPES = ("default", "llama3")


def _rope_scaling(raw: dict, source: str) -> Llama3RopeScaling | None:
    """The RoPE scaling from either layout: rope_scaling beside a top-level rope_theta (published checkpoints) or
    rope_parameters (transformers 5); None for plain RoPE, an error for a type other than llama3."""
    found = None
    for where in (raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}):
        rope_type = where.get("rope_type", where.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only "
                             f"{' and '.join(_ROPE_TYPES)})")
        if rope_type == "llama3":
            scaling = Llama3RopeScaling.from_dict(where, source)
            if found is not None and found != scaling:
                raise ValueError(f"{source}: rope_scaling and rope_parameters disagree")
            found = scaling
    return found


_GGUF_PADDING = re.compile(r"\[PAD\d+\]")  # convert_hf_to_gguf.py's names for the ids past a tokenizer's last


def _same_vocabulary(a: Path, b: Path) -> bool:
    """Two tokenizer.json files give their tokens the same ids (each its added tokens included; a GGUF file's
    converted vocabulary may carry the converter's padding tokens besides)."""
    first, second = (_vocabulary(path) for path in (a, b))
    return (all(second.get(token, i) == i for token, i in first.items())
            and all(_GGUF_PADDING.fullmatch(token) for token in first.keys() ^ second.keys()))


def _vocabulary(tokenizer_json: Path) -> dict[str, int]:
    """A tokenizer.json's token -> id map, its added tokens included."""
    raw = _read_json(tokenizer_json)
    vocab = dict(raw.get("model", {}).get("vocab") or {})
    vocab.update({token["content"]: token["id"] for token in raw.get("added_tokens") or ()})
    return vocab


def _rope_freq_factors(raw: dict, head_dim: int, source: str) -> tuple[float, ...] | None:
    factors = raw.get("rope_freq_factors")
    if factors is None:
        return None
    if _rope_scaling(raw, source) is not None:
        raise ValueError(f"{source}: rope_freq_factors and rope_scaling both scale RoPE; give one")
    if not isinstance(factors, list) or len(factors) != head_dim // 2 or not all(
            isinstance(f, (int, float)) and f > 0 for f in factors):
        raise ValueError(f"{source}: rope_freq_factors must be {head_dim // 2} positive numbers (one per rotary "
                         f"frequency), got {factors!r}")
    return tuple(float(f) for f in factors)


def _rope_theta(raw: dict, source: str) -> float:
    """rope_theta from either layout: top-level (published Qwen2.5) or rope_parameters (transformers 5)."""
    params = raw.get("rope_parameters") or {}
    top, nested = raw.get("rope_theta"), params.get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"{source}: rope_theta={top} disagrees with rope_parameters.rope_theta={nested}")
    theta = top if top is not None else nested
    if theta is None:
        raise ValueError(f"{source}: rope_theta is missing (neither top-level nor in rope_parameters)")
    return float(theta)


def _reject_unsupported_attention(raw: dict, source: str) -> None:
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{source}: sliding-window attention layers are not supported")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a pooling model (task embed or score) turns a prompt into its one output, from the final norm's hidden
    states: pooled at the last token (`pooling_type` "last") or averaged over every prompt token ("mean"); an
    embedding L2-normalised unless the request says otherwise (`normalize`: the model's default); a reranker's score
    sigmoid(logit(yes) - logit(no)) at the last token (`classifier_token_ids`: the (no, yes) ids)."""

    pooling_type: str = "last"
    normalize: bool = True
    classifier_token_ids: tuple[int, int] | None = None


def resolve_task(task: str, mc: ModelConfig, model_dir: Path) -> tuple[str, PoolerConfig | None]:
    """The engine's task and, for a pooling one, its pooler. `auto` takes embed for a base model (BASE_MODEL_
    ARCHITECTURES) or a checkpoint with a sentence-transformers Pooling module (modules.json, as vLLM detects a pooling
    model), score for a Qwen3-Reranker (RERANKER_ARCHITECTURE), else generate; a task the checkpoint cannot serve is
    refused."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    arch, reranker = mc.architecture, mc.architecture == RERANKER_ARCHITECTURE
    sentence_pooling = _sentence_transformers_pooling(model_dir)
    if task == "auto":
        task = "score" if reranker else "embed" if arch in BASE_MODEL_ARCHITECTURES or sentence_pooling else "generate"
    if task == "generate" and arch not in SUPPORTED_ARCHITECTURES:
        kind = "a reranker (task score)" if reranker else "a base model without an LM head (task embed)"
        raise ValueError(f"task generate needs a causal LM ({', '.join(SUPPORTED_ARCHITECTURES)}); {model_dir} is "
                         f"{arch}, {kind}")
    if task == "embed" and reranker:
        raise ValueError(f"{model_dir} is a reranker ({arch}): it serves task score, not embed")
    if task == "score" and not reranker:
        raise ValueError(f"task score needs a Qwen3-Reranker: config.json (or hf_overrides) with architectures "
                         f"[{RERANKER_ARCHITECTURE!r}], classifier_from_token ['no', 'yes'] and "
                         f"is_original_qwen3_reranker true; {model_dir} is {arch} (an embedding model scores pairs by "
                         "the cosine similarity of their embeddings under task embed)")
    if task == "generate":
        return task, None
    if task == "score":
        return task, PoolerConfig(classifier_token_ids=_token_ids(model_dir, mc.classifier_from_token, mc.vocab_size))
    pooling_type, normalize = sentence_pooling or ("last", True)
    return task, PoolerConfig(pooling_type, normalize)


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers checkpoint's modules.json and its Pooling module's
    config.json; None without a Pooling module. Modules mini-infer does not apply (a Dense projection, ...) are
    refused rather than skipped."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise ValueError(f"{path}: expected a list of modules, each with a 'type'")
    kinds = {m["type"].rpartition(".")[2]: m for m in modules}
    if "Pooling" not in kinds:
        return None
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise ValueError(f"{path}: sentence-transformers module {unknown[0]!r} is not supported (mini-infer applies "
                         "Transformer, Pooling and Normalize)")
    pooling_path = model_dir / str(kinds["Pooling"].get("path", "")) / "config.json"
    if not pooling_path.is_file():
        raise FileNotFoundError(f"{path} names a Pooling module whose config is missing: {pooling_path}")
    pooling = _read_json(pooling_path)
    modes = [key for key, value in pooling.items() if key.startswith("pooling_mode_") and value is True]
    if len(modes) != 1 or modes[0] not in POOLING_TYPES:
        raise ValueError(f"{pooling_path}: pooling modes {modes} are not supported; mini-infer pools with exactly one "
                         f"of {', '.join(POOLING_TYPES)}")
    if pooling.get("include_prompt", True) is not True:
        raise ValueError(f"{pooling_path}: include_prompt false (an instruction left out of the mean) is not supported")
    return POOLING_TYPES[modes[0]], "Normalize" in kinds


def _token_ids(model_dir: Path, tokens: tuple[str, ...], vocab_size: int) -> tuple[int, ...]:
    """The ids of a reranker's classifier tokens in the model's tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"classifier_from_token {list(tokens)} needs the model's tokenizer.json (their ids); "
                         f"{model_dir} has none")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    ids = tuple(tokenizer.token_to_id(token) for token in tokens)
    for token, token_id in zip(tokens, ids):
        if token_id is None or token_id >= vocab_size:
            raise ValueError(f"classifier_from_token {token!r} is not one token of {path} within vocab_size "
                             f"{vocab_size}")
    return ids


def resolve_dtype(dtype: str | torch.dtype, model_config: ModelConfig) -> torch.dtype:
    """`auto` takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; choose auto or one of {', '.join(DTYPES)}")
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name == "auto":
        name = _DTYPE_ALIASES.get(model_config.torch_dtype or "float32", model_config.torch_dtype or "float32")
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


CPU_KERNEL_MODES = ("auto", "on", "off")  # what each means: mini_infer.model.ops
# The GPU's Triton kernels (mini_infer.model.triton_ops): auto runs them on a CUDA device; on also runs them on the CPU
# in Triton's interpreter (TRITON_INTERPRET=1: how the tests check the GPU path without a GPU); off runs torch ops.
GPU_KERNEL_MODES = ("auto", "on", "off")
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, quantised at load (mini_infer.kernels.quant)
# Tokens per step with chunked prefill. Prefill is compute-bound, so the budget sets how long a step that carries
# prompt tokens holds the running streams up (0.8-3.7 s p99 at 512 on the 2-core machines here, against 2-12 s
# unchunked); a smaller budget shortens that stall and batches less prompt work per weight read. Why 512, with the
# measurements: docs/decisions/011-chunked-prefill-budget-512.md.
DEFAULT_CHUNKED_BUDGET = 512
# JSON constraints (json schemas, json_object, the tool-call grammars) allow at most this many characters in one run
# of whitespace between their tokens, as llama.cpp's JSON grammars allow a newline and ~20 indentation characters:
# unbounded, an unsure model can spend every token on whitespace and never close the object.
DEFAULT_MAX_JSON_WHITESPACE = 20
# `mini-infer serve`'s decoding-step target (EngineConfig.target_itl_ms): a streaming reader sees a token at least
# this often while new prompts arrive, where the decodes alone fit in it. Why this figure: docs/decisions/017.
SERVE_TARGET_ITL_MS = 90.0
# On a GPU a step's tokens cost little until they fill its matrix units, and every step costs a launch sequence:
# 8192 (vLLM's default for serving) keeps a batch of long prompts to a few steps.
DEFAULT_GPU_CHUNKED_BUDGET = 8192


@dataclass(slots=True)
class EngineConfig:
    """Every engine knob, validated once at construction."""

    model: str  # a model directory, or a GGUF file (gguf_file.py: replaced here by the directory written for it)
    # The tokenizer's directory (vLLM's name): None, the model's (a GGUF file's own vocabulary, converted).
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    cpu_kernels: str = "auto"  # auto, on or off (mini_infer.model.ops)
    gpu_kernels: str = "auto"  # auto, on or off (GPU_KERNEL_MODES)
    # Decode steps replay CUDA graphs captured per padded batch size (runner/graphs.py) where the Triton kernels run;
    # True runs every step eagerly (vLLM's name).
    enforce_eager: bool = False
    # Async scheduling (vLLM's name): each step is planned and launched while the step before it still runs on the
    # device, its sampled tokens pending until then (docs/decisions/032). None: on for one rank generating on a CUDA
    # device without speculative decoding, where the host's work per step would otherwise wait for the device's.
    async_scheduling: bool | None = None
    # Batch-invariant numerics (docs/decisions/023): a request's tokens and logprobs do not depend on what else runs
    # in its steps, how its prompt was chunked, whether it was preempted or its prefix cached. Native CPU kernels only.
    deterministic: bool = False
    # None (the checkpoint's dtype, or its quantization_config's method), int8 or int4 (weight-only, quantised at
    # load), gptq or awq (a checkpoint quantised so).
    quantization: str | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # A decoding step's target time in ms: with requests decoding, prompt chunks are cut to what the scheduler's
    # model of this machine's steps predicts fits in it (engine/scheduler.py); None takes the token budget only.
    # The server's default: SERVE_TARGET_ITL_MS.
    target_itl_ms: float | None = None
    # Characters in one run of whitespace in a JSON constraint (DEFAULT_MAX_JSON_WHITESPACE); None: unbounded.
    structured_outputs_max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # How often one data-parallel replica that dies is started again over the engine's life (with a back-off
    # from 1 s, doubling; docs/decisions/022); 0: never.
    max_replica_restarts: int = 3
    task: str = "auto"  # TASKS; resolved here to generate, embed or score
    hf_overrides: dict | None = None  # keys laid over config.json's (vLLM's name)
    # Speculative decoding (vLLM's name and keys; mini_infer/speculative_config.py): a dict, validated into
    # SpeculativeConfig here.
    speculative_config: SpeculativeConfig | dict | None = None
    model_config: ModelConfig = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    pooler: PoolerConfig | None = field(init=False)  # task embed or score: how a prompt's output is pooled
    # speculative_config's draft model, as an engine config of its own (its kernels, dtype, quantisation)
    draft_config: EngineConfig | None = field(init=False)

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer: no tokenizer.json in {self.tokenizer}")
        if gguf_file.is_gguf(self.model):
            self.model = str(gguf_file.model_dir(self.model, self.tokenizer))
            self.tokenizer = None  # the directory holds the tokenizer asked for
        model_dir = Path(self.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory not found: {model_dir}")
        self.model_config = ModelConfig.from_dir(model_dir, self.hf_overrides)
        self.task, self.pooler = resolve_task(self.task, self.model_config, model_dir)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                             f"got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            budget = DEFAULT_GPU_CHUNKED_BUDGET if torch.device(self.device).type == "cuda" else DEFAULT_CHUNKED_BUDGET
            self.max_num_batched_tokens = budget if self.enable_chunked_prefill else max(self.max_model_len, 2048)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        # Without chunked prefill a whole prompt (or a preempted request's recompute) is one step.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) without chunked prefill: a whole prompt is prefilled in one "
                             "step")
        if self.structured_outputs_max_whitespace is not None:
            _positive("structured_outputs_max_whitespace", self.structured_outputs_max_whitespace)
        if self.target_itl_ms is not None:
            if not self.target_itl_ms > 0:
                raise ValueError(f"target_itl_ms must be > 0, got {self.target_itl_ms}")
            if not self.enable_chunked_prefill:
                raise ValueError("target_itl_ms needs enable_chunked_prefill: it sizes the prompt chunks")
        self.torch_dtype = resolve_dtype(self.dtype, self.model_config)
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNEL_MODES)}, got {self.cpu_kernels!r}")
        if self.model_config.quantization is not None:
            self._check_prequantized()
        elif self.quantization is not None:
            if self.quantization in CHECKPOINT_QUANTIZATION:
                raise ValueError(f"quantization {self.quantization!r} loads a {self.quantization.upper()} checkpoint, "
                                 f"but {self.model}/config.json has no quantization_config")
            if self.quantization not in QUANTIZATION_METHODS:
                methods = ", ".join(QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION)
                raise ValueError(f"quantization must be one of {methods} (or None), got {self.quantization!r}")
            if torch.device(self.device).type != "cpu" or self.torch_dtype == torch.float64:
                raise ValueError(f"quantization {self.quantization!r} runs bfloat16, float16 or float32 models on the "
                                 f"CPU, not {self.torch_dtype} on {self.device}")
            if self.quantization == "int8" and (self.cpu_kernels == "off" or self.torch_dtype == torch.float16):
                raise ValueError("quantization 'int8' runs on mini-infer's native kernels only (torch has no "
                                 "group-wise int8 CPU matmul): it needs cpu_kernels 'auto' or 'on' and a bfloat16 or "
                                 f"float32 model, not cpu_kernels {self.cpu_kernels!r} with {self.torch_dtype}")
        self._check_gpu_kernels()
        self._check_deterministic()
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            _positive(name, getattr(self, name))
        _check_parallel_split(self.model_config, self.tensor_parallel_size, self.pipeline_parallel_size)
        if not isinstance(self.max_replica_restarts, int) or self.max_replica_restarts < 0:
            raise ValueError(f"max_replica_restarts must be an integer >= 0, got {self.max_replica_restarts!r}")
        if self.pooler is not None and self.pipeline_parallel_size != 1:
            raise ValueError(f"task {self.task} runs in one pipeline stage (its pooling reads the last stage's hidden "
                             f"states on rank 0), got pipeline_parallel_size {self.pipeline_parallel_size}")
        self._check_speculative()
        self._check_async_scheduling()

    def _check_async_scheduling(self) -> None:
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be true, false or None (auto), got {self.async_scheduling!r}")
        if self.async_scheduling:
            why = ("a replica of several ranks (tensor or pipeline parallel)" if self.world_size != 1 else
                   f"task {self.task} (it samples nothing)" if self.pooler is not None else
                   "speculative decoding (its drafts are the tokens before them)"
                   if self.speculative_config is not None else None)
            if why is not None:
                raise ValueError(f"async_scheduling is not supported with {why}; leave it None (auto) or false")

    @property
    def runs_ahead(self) -> bool:
        """Whether steps are scheduled ahead (async_scheduling, resolved)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (torch.device(self.device).type == "cuda" and self.world_size == 1 and self.pooler is None
                and self.speculative_config is None)

    def _check_speculative(self) -> None:
        """speculative_config validated, and a draft model's own engine config built (same dtype, kernels, block
        size, sequence slots and length as the target's)."""
        self.speculative_config = spec = SpeculativeConfig.from_value(self.speculative_config)
        self.draft_config = None
        if spec is None:
            return
        if self.pooler is not None:
            raise ValueError(f"speculative_config speeds up generation; task {self.task} generates no tokens")
        if spec.method != "draft_model":
            return
        try:
            self.draft_config = EngineConfig(
                model=spec.model, dtype=self.torch_dtype, device=self.device,
                block_size=self.block_size, num_kv_blocks=1, max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len, seed=self.seed, cpu_kernels=self.cpu_kernels,
                gpu_kernels=self.gpu_kernels, enforce_eager=True, async_scheduling=False,
                deterministic=self.deterministic, quantization=spec.quantization, task="generate")
        except ValueError as e:
            raise ValueError(f"speculative_config.model ({spec.model}): {e}") from e
        draft, target = self.draft_config.model_config, self.model_config
        tokenizers = [Path(d) / "tokenizer.json" for d in (self.draft_config.model, self.model)]
        if all(t.is_file() for t in tokenizers):  # (a GGUF file's, converted, is spelled differently: its tokens)
            same = tokenizers[0].read_bytes() == tokenizers[1].read_bytes() or _same_vocabulary(*tokenizers)
        else:
            same = draft.vocab_size == target.vocab_size
        if not same:
            raise ValueError(f"speculative_config.model ({spec.model}) has another vocabulary than the target "
                             f"({self.model}): a draft proposes token ids of the target's tokenizer")

    @property
    def draft_cost_prior(self) -> float:
        """What a draft's proposing costs, in a decode step, before any is measured (engine/speculation.py
        DraftCost): the draft model's decode weights over the target's (a decode step reads its weights); 0 for the
        n-gram lookup."""
        if self.draft_config is None:
            return 0.0
        return self.draft_config.model_config.decode_weights / self.model_config.decode_weights

    def _check_deterministic(self) -> None:
        """Deterministic mode runs on the native CPU kernels (the ones whose reduction order mini-infer controls);
        where they cannot run, it is refused here rather than run without its promise."""
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        if not self.deterministic:
            return
        if torch.device(self.device).type != "cpu" or self.torch_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"deterministic runs bfloat16 or float32 models on the CPU (mini-infer's native kernels), "
                             f"not {self.torch_dtype} on {self.device}; the GPU kernels are not batch-invariant yet")
        if self.cpu_kernels == "off":
            raise ValueError("deterministic needs the native CPU kernels (cpu_kernels 'auto' or 'on'), got "
                             "cpu_kernels 'off': torch's matmuls reduce in an order that depends on the batch")

    def _check_gpu_kernels(self) -> None:
        if self.gpu_kernels not in GPU_KERNEL_MODES:
            raise ValueError(f"gpu_kernels must be one of {', '.join(GPU_KERNEL_MODES)}, got {self.gpu_kernels!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.gpu_kernels != "on" or torch.device(self.device).type == "cuda":
            return
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"gpu_kernels 'on' runs the Triton kernels on a CUDA device, or on the CPU only in "
                             f"Triton's interpreter (TRITON_INTERPRET=1, for tests); device is {self.device!r}")
        if self.cpu_kernels == "on" or self.quantization is not None:
            raise ValueError("gpu_kernels 'on' on the CPU replaces the native CPU kernels: it takes neither "
                             f"cpu_kernels 'on' nor quantization (got {self.cpu_kernels!r}, {self.quantization!r})")

    def _check_prequantized(self) -> None:
        """A GPTQ/AWQ checkpoint runs as quantised, on the native kernels, bfloat16 (for a float16 checkpoint under
        dtype auto: the kernels take bf16 or float32 activations) or float32, in one tensor-parallel rank."""
        method = self.model_config.quantization.method
        if self.quantization not in (None, method):
            raise ValueError(f"quantization must be None or {method!r} for this checkpoint ({self.model} is quantised "
                             f"by {method}: quantization_config), got {self.quantization!r}")
        self.quantization = method
        if self.dtype == "auto" and self.torch_dtype == torch.float16:
            self.torch_dtype = torch.bfloat16
        if self.torch_dtype not in (torch.bfloat16, torch.float32) or torch.device(self.device).type != "cpu":
            raise ValueError(f"a {method} checkpoint runs bfloat16 or float32 activations on the CPU, not dtype "
                             f"{self.torch_dtype} on {self.device}")
        if self.cpu_kernels == "off":
            raise ValueError(f"a {method} checkpoint runs on mini-infer's native kernels: cpu_kernels must be 'auto' "
                             "or 'on', not 'off'")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1 for a {method} checkpoint (its groups do not split "
                             f"across ranks here), got {self.tensor_parallel_size}")

    @property
    def tokenizer_dir(self) -> Path:
        """Where the tokenizer is read from: `tokenizer`, else the model's directory."""
        return Path(self.tokenizer or self.model)

    @property
    def world_size(self) -> int:
        """Ranks of one replica: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on the rank that holds the most of it (its stage's layers, its share of the KV
        heads): the cache budget is per rank, and every rank has the same number of blocks."""
        mc = self.model_config
        layers = -(-mc.num_hidden_layers // self.pipeline_parallel_size)
        kv_heads = max(1, mc.num_key_value_heads // self.tensor_parallel_size)
        per_token = 2 * layers * kv_heads * mc.head_dim
        if self.draft_config is not None:  # rank 0 holds the draft's K/V over the same blocks, whole
            draft = self.draft_config.model_config
            per_token += 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim
        return per_token * self.block_size * self.torch_dtype.itemsize

    def resolved_num_kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = int(self.kv_cache_memory_gb * 2**30) // self.kv_bytes_per_block()
        # Never reserve more than every sequence slot could use at full length.
        return max(1, min(budget, self.max_num_seqs * self.max_blocks_per_seq))


def _check_parallel_split(mc: ModelConfig, tp: int, pp: int) -> None:
    """Tensor parallel splits query heads, KV heads (or replicates them) and the MLP; pipeline parallel splits
    the layers. Refuse the sizes that do not split this model."""
    heads, kv_heads = mc.num_attention_heads, mc.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} cannot split num_key_value_heads={kv_heads}: the KV heads are "
                         "divided evenly (tp divides them) or replicated (a multiple of them divides tp), "
                         f"so tp must be one of {_split_sizes(heads, kv_heads)}")
    sizes = {"intermediate_size": mc.intermediate_size}
    if mc.moe is not None:
        sizes |= {"moe_intermediate_size": mc.moe.intermediate_size,
                  "shared_expert_intermediate_size": mc.moe.shared_expert_intermediate_size}
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}={size}")
    if pp > mc.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds num_hidden_layers={mc.num_hidden_layers} "
                         "(each stage holds at least one layer)")


def _split_sizes(heads: int, kv_heads: int) -> str:
    sizes = [tp for tp in range(1, heads + 1) if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)]
    return ", ".join(map(str, sizes))


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
