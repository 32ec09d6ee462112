"""EngineArgs: the engine's knobs as command-line flags, defined once for every command that builds an engine
(generate, serve, worker, bench, profile)."""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, asdict, dataclass, fields

from mini_infer.config import (CHECKPOINT_QUANTIZATION, QUANTIZATION_METHODS, SERVE_TARGET_ITL_MS, TASKS,
                               EngineConfig)
from mini_infer.engine.data_parallel import create_engine


def _default(name: str):
    """EngineConfig's default for a field: the flags and the Python API never disagree."""
    default = EngineConfig.__dataclass_fields__[name].default
    assert default is not MISSING, name
    return default


def _ms_or_off(text: str) -> float | None:
    return None if text == "off" else float(text)


def _int_or_off(text: str) -> int | None:
    return None if text == "off" else int(text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@dataclass(slots=True)
class EngineArgs:
    # the model and where it runs
    model: str | None = None  # None: the random-weight qwen2.5-0.5b preset, generated once into the cache
    tokenizer: str | None = _default("tokenizer")
    task: str = _default("task")
    hf_overrides: dict | None = _default("hf_overrides")
    dtype: str = _default("dtype")
    device: str = _default("device")
    quantization: str | None = _default("quantization")
    seed: int = _default("seed")
    # the KV cache
    block_size: int = _default("block_size")
    num_kv_blocks: int | None = _default("num_kv_blocks")
    kv_cache_memory_gb: float = _default("kv_cache_memory_gb")
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    # the scheduler
    max_num_seqs: int = _default("max_num_seqs")
    max_num_batched_tokens: int | None = _default("max_num_batched_tokens")
    max_model_len: int | None = _default("max_model_len")
    target_itl_ms: float | None = _default("target_itl_ms")
    enable_chunked_prefill: bool = _default("enable_chunked_prefill")
    # the kernels
    cpu_kernels: str = _default("cpu_kernels")
    gpu_kernels: str = _default("gpu_kernels")
    enforce_eager: bool = _default("enforce_eager")
    async_scheduling: bool | None = _default("async_scheduling")
    deterministic: bool = _default("deterministic")
    # parallelism
    tensor_parallel_size: int = _default("tensor_parallel_size")
    pipeline_parallel_size: int = _default("pipeline_parallel_size")
    data_parallel_size: int = _default("data_parallel_size")
    max_replica_restarts: int = _default("max_replica_restarts")
    # structured outputs
    structured_outputs_max_whitespace: int | None = _default("structured_outputs_max_whitespace")
    # speculative decoding
    speculative_config: dict | None = _default("speculative_config")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--model", default=None,
                            help="local HF-format model directory (default: the random-weight qwen2.5-0.5b preset, "
                                 "generated once into the cache), or a GGUF file (README: GGUF files)")
        parser.add_argument("--tokenizer", default=None,
                            help="the tokenizer's directory (default: the model's; for a GGUF file, its own "
                                 "vocabulary)")
        parser.add_argument("--task", default=_default("task"), choices=TASKS,
                            help="generate (text), embed (embeddings) or score (a reranker's relevance); auto: embed "
                                 "for a base model or sentence-transformers pooling, score for a Qwen3-Reranker, else "
                                 "generate (README: Embeddings and rerank)")
        parser.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                            help="keys laid over config.json's, as vLLM's --hf-overrides (a Qwen3-Reranker: "
                                 "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                                 "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": "
                                 "true}')")
        parser.add_argument("--dtype", default=_default("dtype"), help="auto, bfloat16, float16, float32 or float64")
        parser.add_argument("--device", default=_default("device"))
        parser.add_argument("--seed", type=int, default=_default("seed"),
                            help="seeds the sampling of requests that give no seed of their own (default 0)")
        parser.add_argument("--block-size", type=int, default=_default("block_size"))
        parser.add_argument("--num-kv-blocks", type=int, default=None)
        parser.add_argument("--kv-cache-memory-gb", type=float, default=_default("kv_cache_memory_gb"))
        parser.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"))
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--cpu-kernels", default=_default("cpu_kernels"), choices=["auto", "on", "off"],
                            help="native CPU kernels for the matmuls and decode attention (auto: on for bf16/fp32 "
                                 "on the CPU when they build)")
        parser.add_argument("--gpu-kernels", default=_default("gpu_kernels"), choices=["auto", "on", "off"],
                            help="mini-infer's Triton kernels for attention and the fused small ops (auto: on a CUDA "
                                 "device; on: also in Triton's interpreter on the CPU, for tests; off: torch ops)")
        parser.add_argument("--enforce-eager", action="store_true",
                            help="run every step eagerly: no CUDA graphs for decode steps (README: GPU)")
        parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                            default=_default("async_scheduling"),
                            help="plan each step while the previous one runs on the device, its sampled tokens "
                                 "pending (default: on for one CUDA rank generating without speculative decoding)")
        parser.add_argument("--deterministic", action="store_true",
                            help="batch-invariant numerics: a request's tokens and logprobs (greedy or seeded) are "
                                 "the same alone or in any batch, under preemption, at any chunk budget, with or "
                                 "without a prefix-cache hit (native CPU kernels; README: Reproducibility)")
        parser.add_argument("--quantization", default=None,
                            choices=[*QUANTIZATION_METHODS, *CHECKPOINT_QUANTIZATION],
                            help="weight-only quantisation at load, of every projection and the LM head: int8 "
                                 "(symmetric) or int4 (symmetric, Q4_0's rounding rule; the LM head int8), in "
                                 "groups of 32 inputs; gptq or awq: a checkpoint quantised so, which loads as it is "
                                 "without this flag too (README: Quantised weights)")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=_default("enable_prefix_caching"),
                            help="reuse the KV blocks of cached prompt prefixes (default on)")
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=_default("enable_chunked_prefill"),
                            help="split prompts into chunks that share steps with decoding (default on; the step's "
                                 "token budget is --max-num-batched-tokens, by default 512 on the CPU, 8192 on a GPU)")
        parser.add_argument("--target-itl-ms", type=_ms_or_off, default=_default("target_itl_ms"), metavar="MS|off",
                            help="while requests decode, cut prompt chunks so that a step is predicted to take at "
                                 "most this many ms (a model of this machine's steps, learnt as they run; needs "
                                 f"chunked prefill). Default: off; for serve {SERVE_TARGET_ITL_MS:g}")
        parser.add_argument("--structured-outputs-max-whitespace", type=_int_or_off, metavar="N|off",
                            default=_default("structured_outputs_max_whitespace"),
                            help="characters in one run of whitespace that a JSON constraint (json_schema, "
                                 "json_object, tool calls) allows between its tokens (default "
                                 f"{_default('structured_outputs_max_whitespace')}, as llama.cpp's JSON grammars; "
                                 "off: unbounded); disable_any_whitespace still allows none")
        parser.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                            help="speculative decoding, as vLLM's: '{\"method\": \"ngram\", "
                                 "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (drafts from the "
                                 "request's own text) or '{\"model\": DRAFT_DIR, \"num_speculative_tokens\": 4}' (a "
                                 "draft model of the same vocabulary); greedy output is unchanged, sampled output "
                                 "keeps its distribution (README: Speculative decoding)")
        parallel = parser.add_argument_group("parallelism (README: Scale-out)")
        parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=_default("tensor_parallel_size"),
                              help="ranks that split every layer (Megatron-style)")
        parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=_default("pipeline_parallel_size"),
                              help="stages that split the layers")
        parallel.add_argument("--data-parallel-size", "-dp", type=int, default=_default("data_parallel_size"),
                              help="engine replicas behind a least-outstanding-work router")
        parallel.add_argument("--max-replica-restarts", type=int, default=_default("max_replica_restarts"),
                              help="times one data-parallel replica that dies is started again (back-off from 1 s, "
                                   "doubling; 0: never); the others serve on meanwhile")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def resolved_model(self) -> str:
        """The model directory: as given, or the default model (written on first use)."""
        if self.model is not None:
            return self.model
        from mini_infer.factory import ensure_default_model

        return str(ensure_default_model())

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(**{**asdict(self), "model": self.resolved_model()})

    def create_engine(self):
        """An LLMEngine, or a DataParallelEngine when data_parallel_size > 1."""
        return create_engine(self.create_engine_config())
