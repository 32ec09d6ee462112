"""mini-infer: a small LLM inference engine for Qwen2.5, Qwen3 (dense) and Llama 3 (and embedding / reranker models of
them) with vLLM's public names."""

from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.llm import LLM
from mini_infer.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                                PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from mini_infer.pooling_params import PoolingParams
from mini_infer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "RequestOutputKind", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "EmbeddingOutput", "ScoringRequestOutput", "ScoringOutput"]
__version__ = "0.1.0"
