"""Tool calling: the chat template lists the tools, and the model's calls become OpenAI tool_calls, read by the
server's tool-call parser (`serve --tool-call-parser`, as vLLM's): "hermes" (the default; the Qwen2.5 family),
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; "llama3_json" (Llama 3.x), JSON objects
{"name": ..., "parameters": {...}} separated by ";", after an optional <|python_tag|>.

tool_choice "auto" parses what the model wrote (text outside the calls stays content), streaming each call's name
and then its arguments as they come; "required" and a named function are enforced with a structured-output grammar
whatever the parser, as vLLM does: "required" by a JSON array of {"name", "parameters"} objects, one of the tools
each (a call goes out as its item closes), a named function by its parameters' schema (the output is its
arguments); "none" leaves the output as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from mini_infer.errors import InvalidRequestError
from mini_infer.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
ARGUMENT_KEYS = {"hermes": ("arguments",), "llama3_json": ("parameters", "arguments")}
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


def check_tool_call_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    return name


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


_WS = " \t\n\r"
_SCALAR_END = _WS + ",]}"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:(?<=[0-9])[eE][-+]?[0-9]*)?)?")  # a prefix
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # json.loads takes the last three too
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JsonEcho:
    """One JSON object or array read a character at a time as a model writes it, and spelled as
    json.dumps(json.loads(text), ensure_ascii=False) spells it as far as it has come (`text`): whitespace dropped,
    ", " and ": " between items, strings and numbers spelled again (a number once the character after it comes).
    Within the outer object or array it takes what Python's json.loads takes, but keeps a key given twice where
    json.loads keeps its last value.

    `members`: where the outer object's or array's members lie in `text`, key (or index) -> [start, end], end None
    while the member is being read; a key given twice keeps its first place."""

    def __init__(self) -> None:
        self.text = ""
        self.state = "value"  # value, key, colon, next (a comma or the closing bracket), string, scalar, done, failed
        self.closers: list[str] = []  # the open containers' closing brackets, the outer one first
        self.first = False  # right after an opening bracket, which may close at once
        self.in_key = False  # the string being read is a key
        self.token = ""  # the scalar, or the string's escape, being read
        self.high: int | None = None  # a \uD800-\uDBFF escape, which the next escape may pair with
        self.key = ""  # the outer object's key being read
        self.members: dict = {}
        self.member = None  # the outer member being read (None: a key given before)

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def feed(self, text: str) -> int:
        """Reads `text` until the value ends or stops being JSON; returns how many characters it took."""
        for i, ch in enumerate(text):
            if self.state in ("done", "failed") or not self._step(ch):
                return i
        return len(text)

    def _step(self, ch: str) -> bool:
        if self.state == "string":
            return self._string(ch)
        if self.state == "scalar":
            if ch not in _SCALAR_END:
                self.token += ch
                return _scalar_start(self.token) or self._fail()
            if not self._end_scalar():
                return False
        if ch in _WS:
            return True
        state, depth = self.state, len(self.closers)
        if state == "value":
            if ch == "]" and self.first:
                return self._close(ch)
            if not (depth or ch in "{["):
                return self._fail()  # the outer value is an object or an array
            if ch != '"' and ch not in "{[" and not _scalar_start(ch):
                return self._fail()
            self._begin()
            if ch in "{[":
                self.text += ch
                self.closers.append("}" if ch == "{" else "]")
                self.state, self.first = ("key" if ch == "{" else "value"), True
            elif ch == '"':
                self.text += ch
                self.state, self.in_key = "string", False
            else:
                self.state, self.token = "scalar", ch
        elif state == "key":
            if ch == "}" and self.first:
                return self._close(ch)
            if ch != '"':
                return self._fail()
            self.text += ch
            self.state, self.in_key, self.key = "string", True, ""
        elif state == "colon":
            if ch != ":":
                return self._fail()
            self.text += ": "
            self.state, self.first = "value", False
        elif ch == ",":  # next
            self.text += ", "
            self.state, self.first = ("key" if self.closers[-1] == "}" else "value"), False
        elif ch == self.closers[-1]:
            return self._close(ch)
        else:
            return self._fail()
        return True

    def _string(self, ch: str) -> bool:
        if self.token:  # an escape
            self.token += ch
            if len(self.token) == 2:
                if ch == "u":
                    return True
                if ch not in _ESCAPES:
                    return self._fail()
                self.token = ""
                self._chars(_ESCAPES[ch])
                return True
            if ch not in "0123456789abcdefABCDEF":
                return self._fail()
            if len(self.token) < 6:
                return True
            code, self.token = int(self.token[2:], 16), ""
            if self.high is not None and 0xDC00 <= code <= 0xDFFF:  # a surrogate pair, as json.loads joins it
                code, self.high = 0x10000 + ((self.high - 0xD800) << 10) + code - 0xDC00, None
            elif 0xD800 <= code <= 0xDBFF:
                self._chars("")  # an earlier high half alone
                self.high = code
                return True
            self._chars(chr(code))
            return True
        if ch == "\\":
            self.token = ch
        elif ch == '"':
            self._chars("")
            self.text += ch
            if self.in_key:
                self.state = "colon"
            else:
                self._end()
        elif ch < " ":
            return self._fail()  # a control character must be escaped
        else:
            self._chars(ch)
        return True

    def _chars(self, chars: str) -> None:
        """A string's next characters (after a high surrogate half that waited for a pair)."""
        if self.high is not None:
            chars, self.high = chr(self.high) + chars, None
        self.text += json.dumps(chars, ensure_ascii=False)[1:-1]
        if self.in_key and len(self.closers) == 1:
            self.key += chars

    def _end_scalar(self) -> bool:
        token, self.token = self.token, ""
        if not (token in _LITERALS or _NUMBER.fullmatch(token)):
            return self._fail()
        try:
            self.text += json.dumps(json.loads(token))
        except ValueError:  # an integer of more than 4,300 digits
            return self._fail()
        self._end()
        return True

    def _begin(self) -> None:
        """A value begins: note it if it is an outer member."""
        if len(self.closers) == 1:
            key = self.key if self.closers[0] == "}" else len(self.members)
            self.member = None if key in self.members else key
            if self.member is not None:
                self.members[key] = [len(self.text), None]

    def _end(self) -> None:
        """A value ended."""
        if not self.closers:
            self.state = "done"
            return
        if len(self.closers) == 1 and self.member is not None:
            self.members[self.member][1] = len(self.text)
        self.state = "next"

    def _close(self, ch: str) -> bool:
        self.text += ch
        self.closers.pop()
        self.first = False
        self._end()
        return True

    def _fail(self) -> bool:
        self.state = "failed"
        return False


def _scalar_start(token: str) -> bool:
    """Whether `token` may begin a number or a literal."""
    return bool(_NUMBER_START.fullmatch(token)) or any(literal.startswith(token) for literal in _LITERALS)


@dataclass(slots=True)
class ToolStream:
    """One choice's tool-call parsing, streamed or whole: text in, OpenAI delta fields out ({"content": ...} or
    {"tool_calls": [...]}); fed the whole text at once, it gives what the streamed deltas merge to.

    auto, hermes: text outside <tool_call> blocks is content (held back while it may begin a block, and its
    whitespace before a block dropped). A block's JSON is read as it comes: once its "name" is read, the call's
    index, id and name go out (arguments ""), then its "arguments" as they are written, spelled as json.dumps spells
    them (see JsonEcho); a block ends at the first </tool_call>. A block whose name never came is content, whole.
    auto, llama3_json: an output that begins (after an optional <|python_tag|> and whitespace) with "{" is read as
    calls {"name": ..., "parameters" (or "arguments"): {...}} separated by ";", streamed as hermes's; text that
    does not begin so is content, and so is the rest from where the text stops being calls.
    A call that went out stays a call whatever follows: the text of its object after it fails to read is dropped
    (llama3_json: is content), and if the output ends inside its arguments they stay cut, and the finish reason is
    the engine's ("length") rather than "tool_calls" (docs/decisions/020).
    required: the JSON array's items, each a whole call once it closes; if the output ends before one closes, its
    text as content. named: the call's id and name first, then its arguments as they come."""

    choice: ToolChoice
    parser: str = "hermes"
    pending: str = ""  # text not yet given out (required: the whole output)
    held: str = ""  # auto: the text before the call object being read, given out with it if it is no call
    reader: JsonEcho | None = None  # the call object (auto) or the array (required) being read
    fed: int = 0  # how much of `pending` the reader took
    open: bool = False  # the reader's call went out (its name)
    sent: int = 0  # how much of the open call's arguments went out
    calls: int = 0  # tool calls given out so far, the open one not counted
    unfinished: bool = False  # the output ended inside a call's arguments
    after_call: bool = False  # a call went out after the last content (whitespace alone is dropped then)
    state: str = "start"  # llama3_json: start (before the first call), between (after a call), content

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas for the output's next text (final: the output ends with it)."""
        deltas = []
        if self.choice.mode == "named":
            if self.calls == 0:
                deltas.append({"tool_calls": [{"index": 0, **new_call(self.choice.name, "")}]})
                self.calls = 1
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        self.pending += text
        if self.choice.mode == "required":
            self._required(deltas, final)
        elif self.parser == "hermes":
            self._hermes(deltas, final)
        else:
            self._llama3_json(deltas, final)
        return deltas

    def _required(self, deltas: list[dict], final: bool) -> None:
        if self.reader is None:
            self.reader = JsonEcho()
        self.fed += self.reader.feed(self.pending[self.fed:])
        for start, end in list(self.reader.members.values())[self.calls:]:
            if end is None:
                break
            item = json.loads(self.reader.text[start:end])
            deltas.append({"tool_calls": [{"index": self.calls, **new_call(
                item["name"], json.dumps(item["parameters"], ensure_ascii=False))}]})
            self.calls += 1
        if final and not self.calls:
            deltas.append({"content": self.pending})

    def _hermes(self, deltas: list[dict], final: bool) -> None:
        while True:
            if self.reader is None:
                start = self.pending.find(OPEN)
                if start < 0:
                    # Held back: an ending that may begin a block, and the whitespace before it.
                    hold = 0 if final else len(self.pending) - len(
                        self.pending[: len(self.pending) - partial_suffix(self.pending, OPEN)].rstrip())
                    self._content(deltas, self.pending[: len(self.pending) - hold])
                    self.pending = self.pending[len(self.pending) - hold:]
                    return
                before = self.pending[:start].rstrip()  # the whitespace between goes if the block is a call
                self._content(deltas, before)
                self.held = self.pending[len(before): start + len(OPEN)]
                self.pending = self.pending[start + len(OPEN):]
                self.reader, self.fed = JsonEcho(), 0
            end = self.pending.find(CLOSE, self.fed)  # (none begins in what the reader took)
            body = end if end >= 0 else len(self.pending) - (0 if final else partial_suffix(self.pending, CLOSE))
            self.reader.feed(self.pending[self.fed: body])
            self.fed = body
            self._call(deltas)
            if end < 0 and not final:
                return
            cut = end < 0  # the output ended inside the block
            end = len(self.pending) if cut else end + len(CLOSE)
            self._end_object(deltas, self.pending[:end], cut)
            self.pending = self.pending[end:]

    def _llama3_json(self, deltas: list[dict], final: bool) -> None:
        while True:
            if self.state == "content":
                if self.pending:
                    deltas.append({"content": self.pending})
                self.pending = ""
                return
            if self.reader is None:
                rest = self.pending.lstrip()
                separator = PYTHON_TAG if self.state == "start" else ";"  # optional before the first call
                separated = rest.startswith(separator)
                if separated:
                    rest = rest[len(separator):].lstrip()
                elif separator.startswith(rest) and not final:
                    return  # whitespace so far, or what may begin the separator
                if not rest:
                    if final:
                        self._content(deltas, self.pending if self.state == "start" else "")
                        self.pending = ""
                    return
                held = self.pending[: len(self.pending) - len(rest)] if self.state == "start" else ""
                if rest[0] != "{" or not (separated or self.state == "start"):
                    self.pending, self.state = held + rest, "content"
                    continue
                self.held, self.pending, self.reader, self.fed = held, rest, JsonEcho(), 0
            self.fed += self.reader.feed(self.pending[self.fed:])
            self._call(deltas)
            cut = not (self.reader.done or self.reader.failed)  # (when final) the output ended inside the object
            if cut and not final:
                return
            if not self.open:  # the object is no call: it and the rest are content
                self.pending, self.state, self.reader = self.held + self.pending, "content", None
                continue
            self.state = "between" if self.reader.done else "content"
            self._end_object(deltas, "", cut)
            self.pending = self.pending[self.fed:]

    def _call(self, deltas: list[dict]) -> None:
        """What the call object read so far gives: its name once read (the call goes out), then its arguments."""
        if not self.open:
            span = self.reader.members.get("name")
            if span is None or span[1] is None:
                return
            name = json.loads(self.reader.text[span[0]: span[1]])
            if not isinstance(name, str):
                return
            deltas.append({"tool_calls": [{"index": self.calls, **new_call(name, "")}]})
            self.open, self.sent, self.after_call = True, 0, True
        span = self._arguments_span()
        if span is not None:
            piece = self.reader.text[span[0] + self.sent: len(self.reader.text) if span[1] is None else span[1]]
            self._arguments(deltas, piece)
            self.sent += len(piece)

    def _end_object(self, deltas: list[dict], text: str, cut: bool) -> None:
        """The call object ends (its text: `text`; cut: by the output's end): its call is done, or it and the text
        before it are content."""
        if not self.open:
            self._content(deltas, self.held + text)
        else:
            span = self._arguments_span()
            if span is None and self.reader.done:
                self._arguments(deltas, "{}")  # no arguments given
            elif cut and (span is None or span[1] is None):
                self.unfinished = True
            self.calls += 1
            self.open = False
        self.reader, self.held = None, ""

    def _arguments_span(self) -> list | None:
        """Where the call's arguments lie in its object's text (llama3_json: "parameters" or "arguments", whichever
        comes first), or None before they begin."""
        keys = ARGUMENT_KEYS[self.parser]
        return next((span for key, span in self.reader.members.items() if key in keys), None)

    def _arguments(self, deltas: list[dict], text: str) -> None:
        """More of the open call's arguments, joined to the delta before if it is the same call's."""
        if not text:
            return
        last = deltas[-1]["tool_calls"][-1] if deltas and "tool_calls" in deltas[-1] else None
        if last is not None and last["index"] == self.calls:
            last["function"]["arguments"] += text
        else:
            deltas.append({"tool_calls": [{"index": self.calls, "function": {"arguments": text}}]})

    def _content(self, deltas: list[dict], text: str) -> None:
        if text.strip() or (text and not self.after_call):
            deltas.append({"content": text})
            self.after_call = False

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" once auto or required gave calls, unless the output was cut inside one's arguments (a named
        call keeps the model's own reason, as OpenAI)."""
        return ("tool_calls" if self.calls and not self.unfinished and self.choice.mode in ("auto", "required")
                else None)


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


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    return next((size for size in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-size:])), 0)
