"""`mini-infer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncLLMEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming with `stream: true`; `n` choices),
POST /v1/responses with GET and DELETE /v1/responses/{id} (the Responses API: responses.py), GET /v1/models and
/v1/models/{id}, POST /tokenize and POST /detokenize (vLLM's), GET /health (with data parallel: each replica's
state), GET /metrics (Prometheus text). Errors come back in OpenAI's shape, {"error": {"message", "type", "param",
"code"}}. An embedding model or a reranker
serves POST /v1/embeddings, /v1/score and /v1/rerank instead (pooling.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mini_infer.config import SERVE_TARGET_ITL_MS
from mini_infer.engine.arg_utils import EngineArgs
from mini_infer.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineShutdownError, RequestFailedError
from mini_infer.engine.input_processor import check_token_ids
from mini_infer.engine.replicas import ReplicaHealth
from mini_infer.entrypoints.openai.choices import ChatChoices, Choices, CompletionChoices, usage_body
from mini_infer.entrypoints.openai.pooling import PoolingEndpoints, check_task
from mini_infer.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    TokenizeRequest)
from mini_infer.entrypoints.openai.reasoning import REASONING_PARSERS, check_reasoning_parser
from mini_infer.entrypoints.openai.responses import (ResponseOutput, ResponsesRequest, ResponseStore, input_messages,
                                                     response_body, responses_error, usage_of)
from mini_infer.entrypoints.openai.shutdown import Drain, DrainMiddleware
from mini_infer.entrypoints.openai.tools import TOOL_CALL_PARSERS, check_tool_call_parser
from mini_infer.errors import InvalidRequestError
from mini_infer.outputs import CompletionOutput, RequestOutput

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}
_ENGINE_FAILURES = (EngineDeadError, RequestFailedError)  # what ends a request on the engine's side


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> Response:
        # ASCII-escaped: a message may quote client input, and a lone surrogate in it cannot be encoded as UTF-8.
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json")


def _check_api_key(api_key: str | None) -> str | None:
    """An empty key would turn auth on with a secret that `Authorization: Bearer ` matches: refuse it."""
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or $MINI_INFER_API_KEY) is empty: give a non-empty key, or unset it to serve "
                         "without authentication")
    return api_key


def build_app(engine: AsyncLLMEngine, served_model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, reasoning_parser: str | None = None,
              chat_template: str | None = None, tool_call_parser: str = "hermes") -> FastAPI:
    """reasoning_parser: how chat answers split their reasoning off (reasoning.py); chat_template: a Jinja chat
    template used instead of the tokenizer's; tool_call_parser: the format of the model's tool calls (tools.py)."""
    app = FastAPI(title="mini-infer", docs_url=None, redoc_url=None, openapi_url=None)
    server = _Server(engine, served_model_name, _check_api_key(api_key), max_body_bytes,
                     check_reasoning_parser(reasoning_parser), chat_template, check_tool_call_parser(tool_call_parser))

    @app.exception_handler(APIError)
    async def _api_error(_request, error: APIError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def _internal_error(_request, error: Exception):
        return APIError(500, f"internal error: {error!r}").response()

    @app.get("/health")
    async def health():
        if (replicas := engine.replicas()) is not None:
            return _replicas_health(engine, replicas)
        if (problem := engine.problem()) is not None:
            raise APIError(503, f"the engine is not running: {problem}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": server.created, "owned_by": "mini-infer",
                "root": str(engine.config.model), "max_model_len": engine.config.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        server.authorize(request)
        if model_id != served_model_name:
            raise APIError(404, f"the model {model_id!a} does not exist; this server serves {served_model_name!a}",
                           "model")
        return model_card()

    def endpoint(body: type[BaseModel], run: Callable):
        async def handle(request: Request):
            return await server.handle(request, body, run)
        return handle

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str):
        server.authorize(request)
        return server.stored_response(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        server.authorize(request)
        server.stored_response(response_id)
        server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    for path, body, run in (("/v1/completions", CompletionRequest, server.completion),
                            ("/v1/chat/completions", ChatCompletionRequest, server.chat_completion),
                            ("/v1/responses", ResponsesRequest, server.create_response),
                            ("/tokenize", TokenizeRequest, server.tokenize),
                            ("/detokenize", DetokenizeRequest, server.detokenize),
                            *PoolingEndpoints(engine, served_model_name, _unless_disconnected, _gather).routes()):
        app.post(path)(endpoint(body, run))

    app.state.drain = Drain()  # what shutdown.serve waits on, and tells to refuse new requests
    app.add_middleware(DrainMiddleware, drain=app.state.drain,
                       refusal=lambda: APIError(503, "the server is shutting down").response())
    return app


class _Server:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, api_key: str | None, max_body_bytes: int,
                 reasoning_parser: str | None, chat_template: str | None, tool_call_parser: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.reasoning_parser = reasoning_parser
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        self.responses = ResponseStore()  # /v1/responses with store: the newest, in memory

    # ---- request plumbing ----

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")

    async def handle(self, request: Request, model: type[BaseModel], run: Callable):
        self.authorize(request)
        body = await self._read_json(request)
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        if parsed.model is not None and parsed.model != self.model_name:
            raise APIError(404, f"the model {parsed.model!a} does not exist; this server serves "
                                f"{self.model_name!a}", "model")
        if (problem := self.engine.problem()) is not None:
            raise APIError(500, f"the engine is not running: {problem}")
        try:
            check_task(self.engine.config.task, request.url.path)  # (pooling.py: a 400 naming model)
            return await run(request, parsed)
        except InvalidRequestError as e:  # refused by SamplingParams, the engine, or a message's content
            param, message = _api_param(e.field, parsed), str(e)
            if e.field == "structured_outputs" and param != e.field:  # the engine's name for the request's field
                message = message.replace("structured_outputs", param, 1)
            raise APIError(400, message, param) from None

    async def _read_json(self, request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8; an int over 4,300 digits; nesting too deep
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    # ---- the two generation endpoints ----

    async def completion(self, request: Request, req: CompletionRequest):
        params = self._sampling_params(req, req.max_tokens, req.logprobs)
        prompts = req.prompts
        if not req.echo:
            return await self._generate(request, req, prompts, params, [CompletionChoices() for _ in prompts])
        # echo: the prompt text before each choice's, and with logprobs the prompt's logprobs before its own.
        tokenizer = self._tokenizer("echo")
        texts = [p if isinstance(p, str) else await asyncio.to_thread(tokenizer.decode, p) for p in prompts]
        if req.logprobs is not None:
            params = replace(params, prompt_logprobs=req.logprobs)
        return await self._generate(request, req, prompts, params,
                                    [CompletionChoices(text, tokenizer.decode) for text in texts])

    async def chat_completion(self, request: Request, req: ChatCompletionRequest):
        prompt = self._render_chat([m.for_template() for m in req.messages], req.add_generation_prompt, req.tools,
                                   req.chat_template_kwargs)
        params = self._sampling_params(req, req.requested_max_tokens, req.requested_logprobs)
        tool_choice = req.parsed_tool_choice
        return await self._generate(request, req, [prompt], params, [ChatChoices(
            req.top_logprobs or 0, tool_choice if tool_choice.mode != "none" else None, self.reasoning_parser,
            self.tool_call_parser)])

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                     template_kwargs: dict | None = None) -> str:
        """The messages (and tools) as the chat template renders them (a 400 naming messages where it cannot, or
        tools where it leaves them out); template_kwargs: the request's chat_template_kwargs."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not (self.chat_template or getattr(tokenizer, "chat_template", None)):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        options = dict(tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.chat_template,
                       **(template_kwargs or {}))
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, **options)
            without_tools = None if not tools else tokenizer.apply_chat_template(messages, **options)
        except Exception as e:  # noqa: BLE001 - the template's own error, reported to the caller
            raise InvalidRequestError(f"the chat template could not render these messages: {e}", "messages") from None
        if text == without_tools:
            raise InvalidRequestError("this model's chat template does not render tools, so the model would not see "
                                      "them", "tools")
        return text

    # ---- the Responses API ----

    async def create_response(self, request: Request, req: ResponsesRequest):
        history = self.stored_response(req.previous_response_id, "previous_response_id")[1] \
            if req.previous_response_id is not None else []
        response_id, created_at = f"resp_{uuid.uuid4().hex}", int(time.time())
        try:
            conversation = [*history, *input_messages(req.input)]
            chat = req.chat_request(conversation)
            prompt = self._render_chat([m.for_template() for m in chat.messages], True, chat.tools,
                                       chat.chat_template_kwargs)
            params = self._sampling_params(chat, chat.requested_max_tokens, None)
            outputs = self.engine.generate(response_id, prompt, params)
            try:
                first = await _unless_disconnected(request, self._first_output(outputs))
            except BaseException:
                await outputs.aclose()
                raise
        except InvalidRequestError as e:
            raise responses_error(e) from None
        if first is None:
            return Response(status_code=499)
        tool_choice = chat.parsed_tool_choice
        output = ResponseOutput(self.reasoning_parser, tool_choice if tool_choice.mode != "none" else None,
                                self.tool_call_parser)

        def body(status: str, cached: int = 0) -> dict:
            config = self.engine.config
            block = config.block_size if config.enable_prefix_caching else None
            usage = None if status == "in_progress" else usage_of(output, len(first.prompt_token_ids), cached, block)
            return response_body(response_id, req, self.model_name, created_at, status=status, output=output.items,
                                 params=params, usage=usage)

        async def run() -> AsyncIterator[dict]:
            """The stream's events, the response's status set and stored once it ends."""
            yield {"type": "response.created", "response": body("in_progress")}
            yield {"type": "response.in_progress", "response": body("in_progress")}
            cached, finish_reason = 0, None
            async for step in _chain(first, outputs):
                completion, cached = step.outputs[0], step.num_cached_tokens
                finish_reason = completion.finish_reason
                for event in output.feed(completion.text, len(completion.token_ids), finish_reason is not None,
                                         cut=finish_reason == "length"):
                    yield event
            whole = body("incomplete" if finish_reason == "length" else "completed", cached)
            if req.store:
                self.responses.put(whole, [*conversation, *output.conversation()])
            # response.completed even when the output was cut (its status says incomplete), as vLLM ends a stream:
            # the openai client's stream helper and the Codex CLI take no other last event.
            yield {"type": "response.completed", "response": whole}

        if req.stream:
            return _SSEResponse(_response_events(run()))

        async def collect() -> dict:
            async for event in run():
                last = event
            return last["response"]

        whole = await _unless_disconnected(request, collect())
        return Response(status_code=499) if whole is None else whole

    def stored_response(self, response_id: str, field: str = "response_id") -> tuple[dict, list[dict]]:
        stored = self.responses.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response has the id {response_id!a} (responses are kept in memory, the "
                                f"newest {self.responses.capacity})", field)
        return stored

    # ---- vLLM's tokenizer endpoints ----

    def _tokenizer(self, field: str):
        if self.engine.tokenizer is None:
            raise APIError(400, "this model directory has no tokenizer.json", field)
        return self.engine.tokenizer

    async def tokenize(self, _request: Request, req: TokenizeRequest):
        tokenizer = self._tokenizer("prompt" if req.prompt is not None else "messages")
        if req.prompt is not None:
            text, special = req.prompt, req.add_special_tokens is not False
        else:
            text = self._render_chat([m.for_template() for m in req.messages], req.add_generation_prompt,
                                     template_kwargs=req.chat_template_kwargs)
            special = bool(req.add_special_tokens)
        # Off the event loop: a 4 MB text takes a while to encode.
        tokens = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=special)
        return {"count": len(tokens), "max_model_len": self.engine.config.max_model_len, "tokens": tokens,
                "token_strs": tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None}

    async def detokenize(self, _request: Request, req: DetokenizeRequest):
        tokenizer = self._tokenizer("tokens")
        check_token_ids(req.tokens, self.engine.config.model_config.vocab_size, "token id", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}

    async def _generate(self, request: Request, req, prompts: list, params, choices: list[Choices]):
        """Run the request, one engine request per prompt (prompt k's choice j is choice k * n + j, as OpenAI
        indexes a batch): an SSE response when it streams, else the whole response body."""
        request_id = f"{choices[0].id_prefix}-{uuid.uuid4().hex}"
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
        outputs = [self.engine.generate(rid, prompt, params) for rid, prompt in zip(ids, prompts)]
        # Watched from the start: a client gone before its first token must not have its prompt prefilled.
        try:
            firsts = await _unless_disconnected(request, _gather(*(self._first_output(o) for o in outputs)))
        except BaseException:  # one prompt refused (or the engine dead): the others do not run either
            await asyncio.gather(*(o.aclose() for o in outputs))
            raise
        if firsts is None:
            return Response(status_code=499)
        meta = dict(id=request_id, created=int(time.time()), model=self.model_name)
        if req.stream:
            return _SSEResponse(_events(_merge([_chain(f, o) for f, o in zip(firsts, outputs)]), firsts,
                                        {**meta, "object": choices[0].chunk_object}, req.usage_mode, choices,
                                        params.n))
        results = await _unless_disconnected(request, _gather(*(_collect(o, f) for o, f in zip(outputs, firsts))))
        if results is None:
            return Response(status_code=499)
        body, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for k, (completions, prompt_token_ids, prompt_logprobs, hits) in enumerate(results):
            choices[k].note_prompt(prompt_token_ids, prompt_logprobs)
            body += [choices[k].choice(k * params.n + i, c.text, c.logprobs, c.finish_reason, c.stop_reason,
                                       streaming=False) for i, c in sorted(completions.items())]
            prompt_tokens += len(prompt_token_ids)
            completion_tokens += sum(len(c.token_ids) for c in completions.values())
            cached += hits
        return {**meta, "object": choices[0].object, "choices": body,
                "usage": usage_body(prompt_tokens, completion_tokens, cached)}

    def _sampling_params(self, req, max_tokens: int | None, logprobs: int | None):
        return req.sampling_params(self.engine.default_sampling_params(), max_tokens, logprobs)

    async def _first_output(self, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Start the request: its first output, or the error that refuses it (then nothing runs): the engine's
        InvalidRequestError, or a 500 if the engine is dead."""
        try:
            return await anext(outputs)
        except _ENGINE_FAILURES as e:
            raise _engine_error(e) from None


async def _events(outputs: AsyncIterator[tuple[int, RequestOutput]], firsts: list[RequestOutput], chunk: dict,
                  usage_mode: str | None, choices: list[Choices], n: int):
    """A request's SSE events from the outputs of its prompts (prompt k's, tagged k): a chunk per output that
    carries tokens, text or logprobs (and the last one), then the usage chunk if asked for, then [DONE].
    usage_mode: None (no usage), "final" (include_usage: a last chunk with the usage, "usage": null in the others)
    or "continuous" (vLLM's continuous_usage_stats: every chunk carries the usage so far too)."""
    prompt_tokens = sum(len(first.prompt_token_ids) for first in firsts)
    num_tokens, cached = 0, [0] * len(firsts)
    opened: set[int] = set()

    def usage() -> dict:
        if usage_mode == "continuous":
            return {"usage": usage_body(prompt_tokens, num_tokens, sum(cached))}
        return {"usage": None} if usage_mode else {}

    async for k, output in outputs:
        cached[k] = output.num_cached_tokens
        choices[k].note_prompt(output.prompt_token_ids, output.prompt_logprobs)
        for completion in output.outputs:  # one chunk per choice that has something new, as vLLM streams n > 1
            index = k * n + completion.index
            opening = choices[k].opening(index) if index not in opened else None
            opened.add(index)
            if opening is not None:
                yield _sse({**chunk, "choices": [opening], **usage()})
            num_tokens += len(completion.token_ids)
            # A new token whose text the detokenizer still holds (part of a UTF-8 character) streams as an empty
            # chunk, as vLLM's do: a client sees every step's token arrive.
            if not (completion.text or completion.token_ids or completion.logprobs or completion.finish_reason):
                continue
            choice = choices[k].choice(index, completion.text, completion.logprobs, completion.finish_reason,
                                       completion.stop_reason, streaming=True)
            if choice is not None:
                yield _sse({**chunk, "choices": [choice], **usage()})
    if usage_mode:
        yield _sse({**chunk, "choices": [], "usage": usage_body(prompt_tokens, num_tokens, sum(cached))})
    yield "data: [DONE]\n\n"


async def _response_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The Responses API's SSE: each event named and numbered in sequence; if the engine dies mid-stream, the last
    one is an error event."""
    number = 0
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield _named_sse(event, number)
                number += 1
        except _ENGINE_FAILURES as e:
            error = _engine_error(e)
            yield _named_sse({"type": "error", "code": str(error.status), "message": error.message, "param": None},
                             number)


def _named_sse(event: dict, number: int) -> str:
    return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number}, ensure_ascii=False)}\n\n"


class _SSEResponse(StreamingResponse):
    """Server-sent events that stop, and abort their request, as soon as the client disconnects (whatever
    ASGI spec version the server speaks): the stream and a disconnect watcher race, the loser is cancelled,
    and the event generator is closed either way."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(_guard_engine_death(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            await self.body_iterator.aclose()


async def _guard_engine_death(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; if the engine dies mid-stream, end with an error event and [DONE]."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except _ENGINE_FAILURES as e:
            yield _sse(_engine_error(e).body())
            yield "data: [DONE]\n\n"


async def _gather(*works):
    """asyncio.gather, its other works cancelled when one fails."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # (done before their streams may be closed)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several prompts' streams as they come, each tagged with its stream's place; closing this
    closes every stream (which aborts what is left of their requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((k, output))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, stream)) for k, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            k, output = await queue.get()
            if output is done:
                remaining -= 1
            else:
                yield k, output
        for task in tasks:
            task.result()  # a stream's error, if one ended with one
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    async with contextlib.aclosing(rest):
        yield first
        if not first.finished:
            async for output in rest:
                yield output


async def _collect(outputs: AsyncIterator[RequestOutput], first: RequestOutput):
    """Run a request to the end: ({index: its whole CompletionOutput}, prompt token ids, prompt logprobs or None,
    prompt tokens found cached), from DELTA outputs."""
    completions: dict[int, CompletionOutput] = {}
    prompt_logprobs, cached = None, 0
    async for output in _chain(first, outputs):
        cached = output.num_cached_tokens
        prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else output.prompt_logprobs
        for delta in output.outputs:
            whole = completions.setdefault(delta.index, CompletionOutput(
                delta.index, "", [], logprobs=[] if delta.logprobs is not None else None))
            whole.text += delta.text
            whole.token_ids += delta.token_ids
            if whole.logprobs is not None:
                whole.logprobs += delta.logprobs
            whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
    return completions, first.prompt_token_ids, prompt_logprobs, cached


async def _unless_disconnected(request: Request, work):
    """Await `work` unless the client disconnects first (then cancel it, which aborts its request; None)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    try:
        return task.result()
    except _ENGINE_FAILURES as e:
        raise _engine_error(e) from None


def _engine_error(error: EngineDeadError | RequestFailedError) -> APIError:
    """A 503 for a request aborted because the server is shutting down, or one that failed alone (its replica died:
    the server serves on, so it may be sent again); a 500 if the engine failed."""
    if isinstance(error, EngineShutdownError):
        return APIError(503, "the server is shutting down; the request was aborted")
    if isinstance(error, RequestFailedError):
        return APIError(503, f"the request failed: {error}; the server serves on, so it may be sent again")
    return APIError(500, str(error))


def _replicas_health(engine: AsyncLLMEngine, replicas: list[ReplicaHealth]) -> Response:
    """A data-parallel engine's /health: the replicas live and each one's state; a 503 saying why when none is live
    (or the engine's thread has stopped)."""
    live = sum(r.state == "live" for r in replicas)
    body = {"status": "ok" if live == len(replicas) else "degraded" if live else "unavailable",
            "live_replicas": live, "total_replicas": len(replicas), "replicas": [asdict(r) for r in replicas]}
    if not live:
        why = "no data-parallel replica is live: " + "; ".join(r.detail for r in replicas)
    elif (problem := engine.problem()) is not None:
        why = f"the engine is not running: {problem}"
    else:
        return Response(json.dumps(body), media_type="application/json")
    return Response(json.dumps({**APIError(503, why).body(), **body}), status_code=503, media_type="application/json")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _api_param(field: str | None, req) -> str | None:
    """The request field behind an engine field (a SamplingParams field or "prompt")."""
    if field == "structured_outputs":
        return req.structured_outputs_field or field
    if isinstance(req, ChatCompletionRequest):
        if field == "prompt":
            return "messages"
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and req.max_completion_tokens is not None:
            return "max_completion_tokens"
    return field


def _validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return APIError(400, str(cause), cause.field)
    loc = first["loc"]
    if not loc:
        return APIError(400, first["msg"])
    # The path without pydantic's union-member tags ("prompt.str" -> "prompt", "messages.0.role" kept).
    path = ".".join(str(p) for p in loc if isinstance(p, int) or not (p in _TYPE_TAGS or "[" in p))
    return APIError(400, f"{path}: {first['msg']} (got {first.get('input')!r:.80})", str(loc[0]))


def load_chat_template(template: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself when it is one (as vLLM takes it)."""
    if template is None:
        return None
    path = Path(template)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(f"--chat-template: {template!r} is neither a file nor a Jinja template")


def add_serve_args(parser):
    """The `serve` subcommand's options plus the engine's."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINI_INFER_API_KEY if set)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --model as given, or the default model's "
                             "directory name)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get a 413")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="on SIGTERM / SIGINT, how long open requests get to finish before they are aborted "
                             "(new ones get a 503 meanwhile; a second signal aborts them at once)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="split a reasoning model's <think> text off its answer: reasoning_content in chat "
                             "completions, a reasoning item in /v1/responses (README: Reasoning models)")
    parser.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                        help="the format of the model's tool calls that tool_choice auto reads: hermes "
                             "(<tool_call> blocks, Qwen2.5) or llama3_json (Llama 3.x's JSON calls)")
    parser.add_argument("--chat-template", default=None, metavar="PATH",
                        help="a Jinja chat template file (or the template itself) to use instead of the "
                             "tokenizer's")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(target_itl_ms=SERVE_TARGET_ITL_MS)  # a server streams: its steps keep to a target
    return parser


def run_server(args) -> int:
    """Load the engine, then serve until interrupted."""
    import gc
    import logging
    import os

    from mini_infer.engine.metrics import EngineMetrics
    from mini_infer.entrypoints.openai.shutdown import serve

    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not args.shutdown_timeout >= 0:  # also refuses nan
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    chat_template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    model_dir = engine_args.resolved_model()
    name = args.served_model_name or args.model or Path(model_dir).name
    api_key = _check_api_key(args.api_key if args.api_key is not None else os.environ.get("MINI_INFER_API_KEY"))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_args.model = model_dir
    engine = AsyncLLMEngine(engine_args.create_engine(), EngineMetrics(name))
    # What the model and engine allocated lives as long as the server: out of the collector's sight, so that no full
    # collection walks it in the middle of a step (vLLM freezes its startup objects too).
    gc.collect()
    gc.freeze()
    app = build_app(engine, name, api_key=api_key, max_body_bytes=args.max_body_bytes,
                    reasoning_parser=args.reasoning_parser, chat_template=chat_template,
                    tool_call_parser=args.tool_call_parser)
    logging.getLogger("mini_infer").info("serving %s (%s) on http://%s:%d/v1", name, model_dir, args.host, args.port)
    try:
        serve(app, engine, host=args.host, port=args.port, log_level=args.log_level,
              shutdown_timeout=args.shutdown_timeout)
    finally:
        engine.shutdown()  # serve() has shut it down unless uvicorn failed to start (a second call is a no-op)
    return 0
