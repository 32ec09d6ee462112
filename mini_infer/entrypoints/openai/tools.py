"""Tool calling for the Qwen2.5 family (vLLM's "hermes" format): the chat template lists the tools, the model answers
with <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, and these become OpenAI tool_calls.

tool_choice "auto" parses what the model wrote (text outside the blocks stays content); "required" and a named
function are enforced with a structured-output grammar, as vLLM does: "required" by a JSON array of
{"name", "parameters"} objects, one of the tools each, a named function by its parameters' schema (the output is
its arguments); "none" leaves the output as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from mini_infer.errors import InvalidRequestError
from mini_infer.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How a request's output is read: mode none, auto, required or named (then `name`)."""

    mode: str
    name: str | None = None


def check_tools(tools: list) -> list[dict]:
    """The request's tools as the template takes them (InvalidRequestError naming tools if one is malformed)."""
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got "
                                      f"{name!r}", "tools")
        if name in names:
            raise InvalidRequestError(f"tools[{i}].function.name {name!r} is given twice", "tools")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type", "object")
                                           == "object"):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema of an object",
                                      "tools")
        if not isinstance(function.get("description", ""), str):
            raise InvalidRequestError(f"tools[{i}].function.description must be a string", "tools")
    return tools


def parse_tool_choice(tool_choice, tools: list[dict] | None) -> ToolChoice:
    """OpenAI's tool_choice (default: auto with tools, none without), checked against the tools."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(tool_choice if tools else "none")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                  "'function': {'name': ...}}", "tool_choice")
    if function["name"] not in {tool["function"]["name"] for tool in tools or ()}:
        raise InvalidRequestError(f"tool_choice names the function {function['name']!r}, which is not among the "
                                  "tools", "tool_choice")
    return ToolChoice("named", function["name"])


def tool_choice_constraint(choice: ToolChoice, tools: list[dict] | None,
                           parallel: bool) -> StructuredOutputsParams | None:
    """The grammar that enforces a required or named choice (None for none and auto)."""
    if choice.mode == "named":
        function = next(t["function"] for t in tools if t["function"]["name"] == choice.name)
        return StructuredOutputsParams(json=_parameters(function))
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t["function"])}}
             for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_calls_as_objects(message: dict) -> dict:
    """An assistant message's tool_calls with their JSON-text arguments as objects, which the template writes out."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list):
        raise InvalidRequestError("messages: an assistant message's tool_calls must be a list", "messages")
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError("messages: each tool call needs function.name and function.arguments",
                                      "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequestError(f"messages: the arguments of the tool call {function['name']!r} are not "
                                          f"JSON: {arguments[:80]!r}", "messages") from None
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": converted}


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_of_block(body: str) -> dict | None:
    """A <tool_call> block's {"name", "arguments"} as a tool call, or None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    return new_call(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))


def _required_calls(text: str) -> list[dict]:
    """The calls of a "required" output (a JSON array of {"name", "parameters"}); none if it was cut short."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [new_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


@dataclass(slots=True)
class ToolStream:
    """One choice's tool-call parsing, streamed or whole: text in, OpenAI delta fields out ({"content": ...} or
    {"tool_calls": [...]}).

    auto: text outside <tool_call> blocks is content (held back while it may begin a block, and its whitespace
    before a block dropped), each block a call once it closes and parses (one that does not parse stays content;
    whitespace between calls is dropped). required: the calls once the output ends (the text as content if it was
    cut short). named: the call's id and name first, then its arguments as they come."""

    choice: ToolChoice
    pending: str = ""  # text not yet given out
    calls: int = 0  # tool calls given out so far
    whole: list[str] = field(default_factory=list)  # required: the output so far

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas for the output's next text (final: the output ends with it)."""
        mode, deltas = self.choice.mode, []
        if mode == "named":
            if self.calls == 0:
                deltas.append({"tool_calls": [{"index": 0, **new_call(self.choice.name, "")}]})
                self.calls = 1
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        if mode == "required":
            self.whole.append(text)
            if final:
                calls = _required_calls("".join(self.whole))
                self.calls = len(calls)
                deltas.append({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls
                              else {"content": "".join(self.whole)})
            return deltas
        self.pending += text
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                # Held back: an ending that may begin a block, and the whitespace before it.
                hold = 0 if final else len(self.pending) - len(
                    self.pending[: len(self.pending) - _partial_open(self.pending)].rstrip())
                self._content(deltas, self.pending[: len(self.pending) - hold])
                self.pending = self.pending[len(self.pending) - hold:]
                return deltas
            before = self.pending[:start].rstrip()  # the whitespace between goes if the block is a call
            self._content(deltas, before)
            self.pending = self.pending[len(before):]
            start -= len(before)
            end = self.pending.find(CLOSE, start)
            if end < 0:  # an open block: wait for its end (or, if the output ended, it is text)
                if final:
                    self._content(deltas, self.pending)
                    self.pending = ""
                return deltas
            call = _call_of_block(self.pending[start + len(OPEN): end])
            if call is None:
                self._content(deltas, self.pending[: end + len(CLOSE)])
            else:
                deltas.append({"tool_calls": [{"index": self.calls, **call}]})
                self.calls += 1
            self.pending = self.pending[end + len(CLOSE):]

    def _content(self, deltas: list[dict], text: str) -> None:
        if text.strip() or (text and self.calls == 0):
            deltas.append({"content": text})

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" once auto or required gave calls (a named call keeps the model's own reason, as OpenAI)."""
        return "tool_calls" if self.calls and self.choice.mode in ("auto", "required") else None


def merge(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """(content or None, whole tool calls) of a choice's deltas."""
    content, calls = [], []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for piece in delta.get("tool_calls", ()):
            if piece["index"] == len(calls):
                calls.append({"id": piece["id"], "type": "function", "function": dict(piece["function"])})
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return "".join(content) or None, calls


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` could begin "<tool_call>"."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
