"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) as vLLM serves it, over the same
chat template, sampling and tool-call parsing as chat completions.

A request becomes a chat completion: `instructions` a system message, `input` (a string or items: messages,
function_call, function_call_output, reasoning) the messages after it, function `tools` and `tool_choice` as chat
takes them, `text.format` as response_format, `max_output_tokens` as max_tokens. The model's text becomes output
items, in the order it writes them: reasoning (with a reasoning parser), message, function_call. Tools the server
would have to run itself (web_search, file_search, ...) are not offered to the model; they are listed back as given.

`store` (the default) keeps a response and its conversation in memory, the newest MAX_STORED_RESPONSES of them, for
GET /v1/responses/{id} and for `previous_response_id`, which continues that conversation.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mini_infer.entrypoints.openai.protocol import ChatCompletionRequest
from mini_infer.entrypoints.openai.reasoning import ReasoningStream
from mini_infer.entrypoints.openai.tools import ToolChoice, ToolStream
from mini_infer.errors import InvalidRequestError

MAX_STORED_RESPONSES = 1000
# The chat request's fields that errors name, as the Responses API spells them.
_FIELDS = {"messages": "input", "prompt": "input", "response_format": "text", "structured_outputs": "text",
           "max_tokens": "max_output_tokens"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto (the default), required or a function
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: echoed; a reasoning model thinks as it does
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    # vLLM's extra fields
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def chat_request(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat completion this request runs: the instructions, then `conversation` (a stored one continued by
        the input's messages) (InvalidRequestError naming this request's field)."""
        if self.background:
            raise InvalidRequestError("background responses are not supported by this server", "background")
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body = {"messages": [*system, *conversation], "tools": self._function_tools(),
                "tool_choice": _chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": _response_format(self.text), "max_tokens": self.max_output_tokens,
                **{name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                          "repetition_penalty", "seed", "chat_template_kwargs")}}
        if not body["tools"]:  # (tool_choice none and auto mean the same then; required and a name are refused)
            body["tools"] = None
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            cause = (first.get("ctx") or {}).get("error")
            if isinstance(cause, InvalidRequestError):
                raise responses_error(cause) from None
            field = str(first["loc"][0]) if first["loc"] else "input"
            raise InvalidRequestError(f"{first['msg']} (in {_FIELDS.get(field, field)})",
                                      _FIELDS.get(field, field)) from None

    def _function_tools(self) -> list[dict]:
        """The function tools, as chat completions takes them; the ones the server would run are left out."""
        tools = []
        for i, tool in enumerate(self.tools or ()):
            if not isinstance(tool.get("type"), str):
                raise InvalidRequestError(f"tools[{i}] needs a type", "tools")
            if tool["type"] == "function":
                tools.append({"type": "function", "function": {
                    key: tool[key] for key in ("name", "description", "parameters") if key in tool}})
        return tools


def responses_error(error: InvalidRequestError) -> InvalidRequestError:
    """An error of the chat request, naming the Responses API's field."""
    field = _FIELDS.get(error.field, error.field)
    return InvalidRequestError(str(error).replace(f"{error.field}", field, 1) if error.field else str(error), field)


def input_messages(items: str | list[dict]) -> list[dict]:
    """The `input` as chat messages: a string is a user message; function calls join the assistant message before
    them (or start one), their outputs are tool messages, and a reasoning item's text is the reasoning_content of
    the assistant message after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise InvalidRequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}",
                                          "input")
            message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequestError(f"{where}.{key} must be a string", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": None}
                messages.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"{where}.call_id must be a string", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _text(item.get("content") or item.get("summary") or [], f"{where}.content")
        else:
            raise InvalidRequestError(f"{where}.type {kind!r} is not supported (message, function_call, "
                                      "function_call_output and reasoning are)", "input")
    return messages


def _text(content, where: str) -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
            raise InvalidRequestError(f"{where}[{j}]: only text parts (input_text, output_text) are supported",
                                      "input")
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool_choice(tool_choice):
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    if tool_choice.get("type") == "function" and isinstance(tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                              "tool_choice")


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat completions' response_format."""
    spec = (text or {}).get("format")
    if spec is None or spec == {"type": "text"}:
        return None
    if not isinstance(spec, dict):
        raise InvalidRequestError("text.format must be an object", "text")
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec.get("schema")}}
    return spec


class ResponseOutput:
    """A response's output items, built from the model's text as it comes (reasoning split off first, then tool
    calls read out of the rest), and the stream events that build them (without their sequence numbers)."""

    def __init__(self, reasoning_parser: str | None, tool_choice: ToolChoice | None, tool_call_parser: str) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.tools = ToolStream(tool_choice, tool_call_parser) if tool_choice is not None else None
        self.output_tokens = self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int, final: bool, cut: bool = False) -> list[dict]:
        """The events for the output's next text and tokens (final: the output ends with them; cut: by its token
        limit)."""
        self.output_tokens += num_tokens
        events, content = [], text
        if self.reasoning is not None:
            if self.reasoning.state != "content":  # tokens written while thinking, its closing tag among them
                self.reasoning_tokens += num_tokens
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                events += self._write("reasoning", reasoning)
        deltas = self.tools.feed(content, final) if self.tools is not None else [{"content": content}]
        for delta in deltas:
            if delta.get("content"):
                events += self._write("message", delta["content"])
            for piece in delta.get("tool_calls", ()):
                if "id" in piece:
                    events += self._open_call(piece)
                if piece["function"].get("arguments"):
                    events += self._write("function_call", piece["function"]["arguments"])
        if final:
            events += self._close("incomplete" if cut else "completed")
        return events

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            events += self._open(_new_item(kind))
        item, where = self.open, self._where()
        if kind == "function_call":
            item["arguments"] += text
            return [*events, {"type": "response.function_call_arguments.delta", **where, "delta": text}]
        item["content"][0]["text"] += text
        if kind == "reasoning":
            return [*events, {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text}]
        return [*events, {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text,
                          "logprobs": []}]

    def _open_call(self, piece: dict) -> list[dict]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": piece["id"],
                "name": piece["function"]["name"], "arguments": "", "status": "in_progress"}
        return [*self._close("completed"), *self._open(item)]

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]
        if "content" in item:  # a message or reasoning: added empty, then its one text part
            events[0]["item"]["content"] = []
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": dict(item["content"][0])})
        return events

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            done = {"type": f"response.{kind}.done", **where, "content_index": 0, "text": part["text"]}
            if kind == "output_text":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        return [*events, {"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": item}]

    def _where(self, item: dict | None = None) -> dict:
        item = item or self.open
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def conversation(self) -> list[dict]:
        """The output as the assistant message that continues the conversation (previous_response_id)."""
        message: dict = {"role": "assistant", "content": None}
        for item in self.items:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = (message["content"] or "") + item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return [message]


def _new_item(kind: str) -> dict:
    if kind == "reasoning":
        return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}


def response_body(response_id: str, req: ResponsesRequest, model: str, created_at: int, *, status: str,
                  output: list[dict], params=None, usage: dict | None = None) -> dict:
    """The response object (status in_progress, completed or incomplete)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store,
        "temperature": params.temperature if params is not None else req.temperature,
        "top_p": params.top_p if params is not None else req.top_p,
        "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "truncation": "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {},
    }


def usage_of(output: ResponseOutput, input_tokens: int, cached_tokens: int, cache_block: int | None) -> dict:
    """cache_block: the prefix cache's block size (None: no prefix caching), which caches a prompt's whole blocks."""
    written = (input_tokens // cache_block * cache_block - cached_tokens) if cache_block else 0
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": max(written, 0)},
            "output_tokens": output.output_tokens,
            "output_tokens_details": {"reasoning_tokens": output.reasoning_tokens},
            "total_tokens": input_tokens + output.output_tokens}


class ResponseStore:
    """The stored responses, newest last: id -> (response object, its conversation as chat messages, instructions
    left out). At most `capacity`; the oldest goes first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> None:
        self.entries[body["id"]] = (body, conversation)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None
