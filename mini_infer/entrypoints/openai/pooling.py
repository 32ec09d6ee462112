"""The pooling endpoints of `mini-infer serve`, as vLLM serves them for an embedding model (task embed) or a reranker
(task score): POST /v1/embeddings (OpenAI's), POST /v1/score (vLLM's: text_1, text_2) and POST /v1/rerank (with the
alias /v2/rerank: Jina's and Cohere's shape, as vLLM's: query, documents, top_n, return_documents).

Each takes its inputs as one batch: every prompt goes to the engine at once (a refused one fails the request and
aborts the others; a client that leaves aborts them all). An embedding model scores a pair by the cosine similarity of
its two embeddings (each distinct text embedded once); a reranker by its score of the pair's joined prompt
(engine/scoring.py). Which endpoints a server's model takes is its task's (check_task): the others get a 400 naming
`model`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, model_validator

from mini_infer.engine.async_engine import AsyncLLMEngine
from mini_infer.engine.scoring import PairSide, cosine_similarities, distinct, pair_prompt, score_pairs
from mini_infer.errors import InvalidRequestError
from mini_infer.outputs import PoolingRequestOutput
from mini_infer.pooling_params import PoolingParams

MAX_INPUTS = 2048  # inputs one request may list (OpenAI's limit for /v1/embeddings)
ENCODING_FORMATS = ("float", "base64")  # base64: the little-endian float32 bytes, as OpenAI's
# The tasks each pooling endpoint serves; every other endpoint with a body is generation's, bar the tokenizer's.
POOLING_ENDPOINTS = {"/v1/embeddings": ("embed",), "/v1/score": ("embed", "score"), "/v1/rerank": ("embed", "score"),
                     "/v2/rerank": ("embed", "score")}
ANY_TASK = ("/tokenize", "/detokenize")


def check_task(task: str, path: str) -> None:
    """Refuse an endpoint the model's task does not serve (InvalidRequestError naming `model`)."""
    needed = POOLING_ENDPOINTS.get(path, ("generate",))
    if path in ANY_TASK or task in needed:
        return
    served = [endpoint for endpoint, tasks in POOLING_ENDPOINTS.items() if task in tasks] or ["text generation"]
    raise InvalidRequestError(f"this server's model runs task {task}; {path} needs a model of task "
                              f"{' or '.join(needed)} (this one serves {', '.join(served)})", "model")


class _PoolingRequest(BaseModel):
    # Strict: JSON's own types only, as the other request bodies; unknown fields are ignored, as OpenAI's and vLLM's.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the served model
    user: str | None = None


class EmbeddingRequest(_PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None  # matryoshka models only (PoolingParams)
    normalize: bool | None = None  # vLLM's extra field

    @model_validator(mode="after")
    def _checks(self):
        if self.encoding_format not in ENCODING_FORMATS:
            raise InvalidRequestError(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got "
                                      f"{self.encoding_format!r}", "encoding_format")
        if not self.input:
            raise InvalidRequestError("input must not be empty", "input")
        if len(self.inputs) > MAX_INPUTS:
            raise InvalidRequestError(f"input: at most {MAX_INPUTS} inputs a request, got {len(self.inputs)}",
                                      "input")
        self.pooling_params()  # refused here, naming its field
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """The request's inputs: one, or the batch it lists."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


class ScoreRequest(_PoolingRequest):
    """vLLM's /v1/score: one text_1 against each text_2, or equally long lists paired in order."""

    text_1: str | list[str] | list[int] | list[list[int]]
    text_2: str | list[str] | list[int] | list[list[int]]

    @model_validator(mode="after")
    def _checks(self):
        _check_pairs(self.text_1, self.text_2, ("text_1", "text_2"))
        return self

    @property
    def pairs(self) -> list[tuple]:
        return score_pairs(self.text_1, self.text_2)


class RerankRequest(_PoolingRequest):
    """Jina's and Cohere's rerank body, as vLLM takes it: the documents ranked by their relevance to the query,
    the top_n best (all for None or 0), each with its text unless return_documents is false."""

    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True

    @model_validator(mode="after")
    def _checks(self):
        _check_pairs(self.query, self.documents, ("query", "documents"))
        if self.top_n is not None and self.top_n < 0:
            raise InvalidRequestError(f"top_n must be >= 0 (0: every document), got {self.top_n}", "top_n")
        return self

    @property
    def pairs(self) -> list[tuple]:
        return score_pairs(self.query, self.documents, ("query", "documents"))


def _check_pairs(first: PairSide, second: PairSide, names: tuple[str, str]) -> None:
    count = len(score_pairs(first, second, names))  # (refuses empty or mismatched sides, naming them)
    if count > MAX_INPUTS:
        raise InvalidRequestError(f"{names[1]}: at most {MAX_INPUTS} pairs a request, got {count}", names[1])


class PoolingEndpoints:
    """The handlers, over the server's engine, with the server's plumbing (api_server.py's, which imports this
    module): `unless_disconnected(request, work)` awaits work unless the client leaves first (then cancels it and
    returns None) and turns the engine's death into the server's error; `gather(*works)` is asyncio.gather with the
    other works cancelled when one fails."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, unless_disconnected: Callable,
                 gather: Callable) -> None:
        self.engine, self.model_name = engine, model_name
        self.unless_disconnected, self.gather = unless_disconnected, gather

    def routes(self) -> list[tuple[str, type[BaseModel], Callable]]:
        """(path, request body, handler) of each endpoint."""
        return [("/v1/embeddings", EmbeddingRequest, self.embeddings), ("/v1/score", ScoreRequest, self.score),
                ("/v1/rerank", RerankRequest, self.rerank), ("/v2/rerank", RerankRequest, self.rerank)]

    async def embeddings(self, request: Request, req: EmbeddingRequest):
        outputs = await self._encode(request, req.inputs, req.pooling_params(), "input")
        if outputs is None:
            return Response(status_code=499)
        data = [{"index": i, "object": "embedding", "embedding": _encoded(o.outputs.embedding, req.encoding_format)}
                for i, o in enumerate(outputs)]
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(self, request: Request, req: ScoreRequest):
        scored = await self._scores(request, req.pairs, "text_2")
        if scored is None:
            return Response(status_code=499)
        scores, tokens = scored
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_name, "data": [{"index": i, "object": "score", "score": s}
                                                   for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, request: Request, req: RerankRequest):
        scored = await self._scores(request, req.pairs, "documents")
        if scored is None:
            return Response(status_code=499)
        scores, tokens = scored
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [{"index": i, **({"document": {"text": req.documents[i]}} if req.return_documents else {}),
                    "relevance_score": scores[i]} for i in ranked]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name, "usage": {"total_tokens": tokens},
                "results": results}

    async def _scores(self, request: Request, pairs: list[tuple], field: str) -> tuple[list[float], int] | None:
        """Each pair's score and the prompt tokens computed for them (None if the client left)."""
        if self.engine.config.task == "embed":
            unique, index = distinct([item for pair in pairs for item in pair])
            outputs = await self._encode(request, unique, PoolingParams(), field)
            if outputs is None:
                return None
            vectors = [outputs[i].outputs.embedding for i in index]  # first, second, first, second, ...
            return (cosine_similarities(vectors[0::2], vectors[1::2]),
                    sum(len(o.prompt_token_ids) for o in outputs))
        tokenizer = self.engine.tokenizer
        # Off the event loop: long documents take a while to encode.
        prompts = await asyncio.to_thread(lambda: [pair_prompt(tokenizer, a, b) for a, b in pairs])
        outputs = await self._encode(request, prompts, PoolingParams(), field)
        if outputs is None:
            return None
        return [o.outputs.score for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)

    async def _encode(self, request: Request, prompts: list, params: PoolingParams,
                      field: str) -> list[PoolingRequestOutput] | None:
        """Every prompt through the engine at once, their outputs in order; None if the client left first. A refused
        prompt fails the request (its message naming the request's `field`, and which item with several)."""
        request_id = f"pool-{uuid.uuid4().hex}"

        async def one(k: int, prompt) -> PoolingRequestOutput:
            try:
                async with contextlib.aclosing(self.engine.encode(f"{request_id}-{k}", prompt, params)) as outputs:
                    return await anext(outputs)
            except InvalidRequestError as e:
                if e.field != "prompt":
                    raise
                where = f"{field}[{k}]" if len(prompts) > 1 else field
                raise InvalidRequestError(str(e).replace("prompt", where, 1), field) from None

        # (one failing cancels the others, which aborts their requests)
        return await self.unless_disconnected(request, self.gather(*(one(k, p) for k, p in enumerate(prompts))))


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()
