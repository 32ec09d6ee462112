"""Tool calling (Qwen2.5's <tool_call> format, and Llama 3's JSON with --tool-call-parser llama3_json) through the
official openai client: the chat template renders the tools, the tool calls and the tool results; auto output is
parsed, its calls streamed as name then argument fragments that join to the whole parse however the text is cut;
required and named choices are enforced by a grammar, required's calls going out as their items close; malformed
tools and tool_choice are a 400 naming the field."""

from __future__ import annotations

import argparse
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.entrypoints.openai.api_server import add_serve_args, build_app
from mini_infer.entrypoints.openai.choices import ChatChoices
from mini_infer.entrypoints.openai.tools import JsonEcho, ToolChoice, ToolStream, check_tool_call_parser, merge
from mini_infer.factory.tokenizer import CHAT_TEMPLATE
from tests.test_server import MODEL_NAME, ServerThread, post, serving
from tests.test_server import client as openai_client

KEY = "sk-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _literal(text: str) -> str:
    """A regex (xgrammar's dialect) that matches exactly `text`."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in ".^$*+?()[]{}|\\/" else c for c in text)

# A Qwen2.5 answer with two calls, as the chat template asks for them (forced on the random model by a regex).
CALL_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>')


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving(tiny_model_dir, api_key=KEY) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1], KEY)


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def _valid_call(name: str, arguments: dict) -> bool:
    schema = next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]
    if set(arguments) != set(schema["required"]):
        return False
    for key, value in arguments.items():
        rule = schema["properties"][key]
        if "enum" in rule and value not in rule["enum"]:
            return False
        if rule.get("type") == "integer" and not (isinstance(value, int) and rule["minimum"] <= value
                                                  <= rule["maximum"]):
            return False
    return True


def test_the_template_renders_tools_calls_and_results(tiny_model_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"}, {"role": "tool", "content": "sunny"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    plain = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in plain and plain.startswith("<|im_start|>system\nYou are Qwen")


@pytest.mark.parametrize("text", [CALL_TEXT, "no call < here <tool", "  spaces  ", "x <tool_call>{bad}</tool_call> y",
                                  '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'])
def test_streamed_parsing_equals_whole_parsing_however_the_text_is_cut(text):
    whole = merge(ToolStream(ToolChoice("auto")).feed(text, final=True))
    for seed in range(100):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolStream(ToolChoice("auto"))
        deltas = [d for i, piece in enumerate(pieces) for d in stream.feed(piece, final=i == len(pieces) - 1)]
        content, calls = merge(deltas)
        assert content == whole[0] and [c["function"] for c in calls] == [c["function"] for c in whole[1]], pieces


def test_whole_parsing():
    content, calls = merge(ToolStream(ToolChoice("auto")).feed(CALL_TEXT, final=True))
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": 2})]
    assert len({c["id"] for c in calls}) == 2
    content, calls = merge(ToolStream(ToolChoice("auto")).feed("x <tool_call>{bad}</tool_call>", final=True))
    assert content == "x <tool_call>{bad}</tool_call>" and calls == []


# JSON values, and the ways a model may spell them (json.loads reads them all the same).
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
SPELLINGS = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": False},
                             {"indent": "\t", "separators": (" ,", " :  ")}])
NAMES = st.sampled_from(["get_weather", "get_time"])


def _pieces(data, text: str) -> list[str]:
    """`text` cut at random places, as a stream's chunks may cut it."""
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)) & set(range(1, len(text))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _parse(text: str, parser: str, pieces: list[str] | None = None) -> tuple:
    """(content, [(name, arguments)], finish reason) of `text` read whole or fed as `pieces`."""
    stream = ToolStream(ToolChoice("auto"), parser)
    pieces = pieces or [text]
    deltas = [d for i, piece in enumerate(pieces) for d in stream.feed(piece, final=i == len(pieces) - 1)]
    content, calls = merge(deltas)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], stream.finish_reason


def _streams_as_whole(data, text: str, parser: str) -> tuple:
    """The whole parse of `text`, checked to be what its deltas give streamed in random pieces, and also when it is
    cut short at a random place (as max_tokens cuts an output)."""
    whole = _parse(text, parser)
    assert _parse(text, parser, _pieces(data, text)) == whole
    cut = text[: data.draw(st.integers(0, len(text)))]
    assert _parse(cut, parser, _pieces(data, cut)) == _parse(cut, parser)
    return whole


@settings(max_examples=150, deadline=None)
@given(st.data(), VALUES)
def test_json_echo_spells_json_as_json_dumps_does(data, value):
    text = json.dumps({"name": "f", "arguments": value}, **data.draw(SPELLINGS))
    echo = JsonEcho()
    assert sum(echo.feed(piece) for piece in _pieces(data, text)) == len(text) and echo.done
    assert echo.text == json.dumps(json.loads(text), ensure_ascii=False)
    start, end = echo.members["arguments"]
    assert echo.text[start:end] == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("text", ['{"a": [-0, 1E400, 0.10, 1e-2, -1.5e+3, NaN, -Infinity, true, null]}',
                                  r'{"s\u00e9": "\ud83d\ude00 \ud800\u0041\/\"\n\u001f"}', '[{}, [], {"a": {}}]'])
def test_json_echo_respells_numbers_and_escapes(text):
    echo = JsonEcho()
    assert echo.feed(text) == len(text) and echo.done
    assert echo.text == json.dumps(json.loads(text), ensure_ascii=False)


@pytest.mark.parametrize("text", ['{"a": 01}', '{"a": 1,}', '{"a" 1}', '{"a": "\x01"}', r'{"a": "\x"}',
                                  '{"a": tru}', '{"a": 1.}', "{'a': 1}", "[1 2]", '{"a": [1}'])
def test_json_echo_stops_where_the_text_is_not_json(text):
    echo = JsonEcho()
    assert echo.feed(text) < len(text) and echo.failed
    with pytest.raises(ValueError):
        json.loads(text)


@st.composite
def hermes_outputs(draw):
    """(an output in the hermes format, the calls of its well-formed blocks as they are parsed whole)."""
    parts, calls = [], []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["content", "call", "call", "no call"]))
        if kind == "content":
            parts.append(draw(st.sampled_from(["Let me check.", " ", "\n", "a < b", "<tool", "</tool_call>"])))
        elif kind == "no call":
            parts.append(draw(st.sampled_from(["<tool_call>{bad}</tool_call>", '<tool_call>{"name": 5}</tool_call>',
                                               '<tool_call>{"arguments": {}}</tool_call>'])))
        else:
            name, value = draw(NAMES), draw(VALUES)
            body = draw(st.sampled_from([{"name": name, "arguments": value}, {"arguments": value, "name": name},
                                         {"name": name}]))
            parts.append("<tool_call>\n" + json.dumps(body, **draw(SPELLINGS)) + "\n</tool_call>")
            calls.append((name, json.dumps(body.get("arguments", {}), ensure_ascii=False)))
    return "".join(parts), calls


@settings(max_examples=300, deadline=None)
@given(st.data(), hermes_outputs())
def test_hermes_streams_the_whole_parse(data, output):
    """Well-formed blocks give the calls json.dumps spells; however the output is cut into chunks, or cut short,
    the streamed deltas merge to the whole parse (content, calls and finish reason)."""
    text, calls = output
    content, parsed, finish = _streams_as_whole(data, text, "hermes")
    assert parsed == calls and finish == ("tool_calls" if calls else None)


@st.composite
def llama3_outputs(draw):
    """(an output in the llama3_json format, its calls as they are parsed whole)."""
    text, calls = draw(st.sampled_from(["", "<|python_tag|>", " "])), []
    for i in range(draw(st.integers(0, 3))):
        name, value = draw(NAMES), draw(VALUES)
        key = draw(st.sampled_from(["parameters", "arguments"]))
        text += (draw(st.sampled_from([";", "; ", " ;\n"])) if i else "") + json.dumps({"name": name, key: value},
                                                                                       **draw(SPELLINGS))
        calls.append((name, json.dumps(value, ensure_ascii=False)))
    return text + draw(st.sampled_from(["", "\n", " Done."])), calls


@settings(max_examples=200, deadline=None)
@given(st.data(), llama3_outputs())
def test_llama3_json_streams_the_whole_parse(data, output):
    text, calls = output
    content, parsed, finish = _streams_as_whole(data, text, "llama3_json")
    assert parsed == calls and finish == ("tool_calls" if calls else None)
    assert content == (("Done." if text.endswith("Done.") else None) if calls else text or None)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_time", "parameters": {"zone": 2}}; then text', "then text", [("get_time", '{"zone": 2}')]),
    ('Sure: {"name": "get_time", "parameters": {}}', 'Sure: {"name": "get_time", "parameters": {}}', []),
    ('<|python_tag|>{"nom": "get_time"} x', '<|python_tag|>{"nom": "get_time"} x', []),
    ('{"name": "get_time", "parameters": {}} {"name": "f"}', '{"name": "f"}', [("get_time", "{}")]),
    ('{"name": "get_time", "parameters": {"zone": 2 3}}', "3}}", [("get_time", '{"zone": 2')]),
    (CALL_TEXT, CALL_TEXT, []),  # hermes's blocks
])
def test_llama3_json_reads_calls_until_the_text_stops_being_calls(text, content, calls):
    assert _parse(text, "llama3_json")[:2] == (content, calls)


def test_calls_stream_their_name_then_argument_fragments():
    """The id, type and name go out once the name is read (arguments ""), then the arguments as they are written,
    without the block's closing } or </tool_call>."""
    stream = ToolStream(ToolChoice("auto"))
    pieces = [piece for i in range(0, len(CALL_TEXT), 5)
              for piece in stream.feed(CALL_TEXT[i:i + 5], final=i + 5 >= len(CALL_TEXT)) if "tool_calls" in piece]
    first = pieces[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"] and first["function"] == {"name": "get_weather", "arguments": ""}
    weather = [p["tool_calls"][0]["function"]["arguments"] for p in pieces if p["tool_calls"][0]["index"] == 0]
    assert len(weather) > 5 and "".join(weather) == '{"city": "Rome", "unit": "C"}'
    assert all(set(p["tool_calls"][0]) == {"index", "function"} for p in pieces[1:] if
               p["tool_calls"][0]["index"] == 0)


def test_a_call_cut_by_max_tokens_keeps_what_went_out():
    """Its name and arguments went out as they came, so the whole answer keeps them too, cut; the finish reason is
    "length", not "tool_calls"."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    choices = ChatChoices(0, ToolChoice("auto"))
    whole = choices.choice(0, text, None, "length", None, streaming=False)
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == "Sure."
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Ro'}]
    chunks = [choices.choice(0, text[i:i + 4], None, "length" if i + 4 >= len(text) else None, None, streaming=True)
              for i in range(0, len(text), 4)]
    assert chunks[-1]["finish_reason"] == "length"
    deltas = [c["delta"] for c in chunks if c is not None]
    assert merge(deltas)[0] == "Sure." and [c["function"] for c in merge(deltas)[1]] == [
        c["function"] for c in whole["message"]["tool_calls"]]


def test_required_gives_each_call_as_its_item_closes():
    text = ('[{"name": "get_time", "parameters": {"zone": 2}}, {"name": "get_weather", "parameters": '
            '{"city": "Rome", "unit": "C"}}, {"name": "get_ti')
    stream = ToolStream(ToolChoice("required"), "llama3_json")  # the grammar's array, whatever the parser
    closes = text.index("}}") + 2
    assert stream.feed(text[:closes - 1], final=False) == []
    deltas = stream.feed(text[closes - 1: closes], final=False)
    assert [c["function"] for c in merge(deltas)[1]] == [{"name": "get_time", "arguments": '{"zone": 2}'}]
    deltas += stream.feed(text[closes:], final=True)  # cut inside the third item, as max_tokens would
    content, calls = merge(deltas)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert stream.finish_reason == "tool_calls"
    cut = ToolStream(ToolChoice("required"))  # cut before any item closed: the text is the content
    assert merge(cut.feed(text[:20], final=True)) == (text[:20], []) and cut.finish_reason is None


def test_the_tool_call_parser_option():
    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args([]).tool_call_parser == "hermes"
    assert parser.parse_args(["--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_tool_call_parser("mistral")


def _collect(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed answer's content, calls (name, arguments text) and finish reason, joined as a client joins them."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            assert piece.index in calls or (piece.id and piece.function.name), piece  # a call's first piece
            calls.setdefault(piece.index, [piece.function.name, ""])[1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(call) for call in calls.values()], finish


def test_auto_parses_the_models_tool_calls(client):
    """The random model is made to write CALL_TEXT by a regex; auto turns it into content and two tool_calls."""
    answer = client.chat.completions.create(model="tiny-test", messages=ASK, tools=TOOLS, max_tokens=200,
                                            temperature=0, extra_body={"guided_regex": _literal(CALL_TEXT)})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert [(c.function.name, _args(c)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": 2})]
    # streamed: the same calls, as OpenAI tool-call deltas
    content, calls, finish = _collect(client.chat.completions.create(
        model="tiny-test", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0, stream=True,
        extra_body={"guided_regex": _literal(CALL_TEXT)}))
    assert content == "Let me check." and finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_without_a_call_is_plain_content(client):
    answer = client.chat.completions.create(model="tiny-test", messages=ASK, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    choice = answer.choices[0]
    assert not choice.message.tool_calls and choice.message.content and choice.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_a_tool_with_valid_arguments(client, stream):
    kwargs = dict(model="tiny-test", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                  parallel_tool_calls=False,  # one call: a random model would go on adding calls
                  temperature=0.7, seed=3, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, _args(c)) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        _, calls, finish = _collect(client.chat.completions.create(**kwargs, stream=True))
        calls = [(name, json.loads(arguments)) for name, arguments in calls]
    assert finish == "tool_calls" and calls
    assert all(_valid_call(name, arguments) for name, arguments in calls), calls


def test_required_yields_tool_calls_at_temperature_one_when_cut(client):
    """Sampled at temperature 1 within 80 tokens, with parallel calls allowed, a random model goes on adding items
    to the array until max_tokens cuts it; the items that closed are its calls. Every answer of a concurrent batch
    (half of them streamed) calls a tool with valid arguments. (The grammar's whitespace is bounded by default:
    unbounded, a random model spent its tokens on whitespace inside the array.)"""
    def ask(seed: int) -> tuple:
        kwargs = dict(model="tiny-test", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                      temperature=1.0, seed=seed)
        if seed % 2:
            _, calls, finish = _collect(client.chat.completions.create(**kwargs, stream=True))
            return finish, [(name, json.loads(arguments)) for name, arguments in calls]
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.finish_reason, [(c.function.name, _args(c)) for c in choice.message.tool_calls or ()]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for finish, calls in answers:
        assert finish == "tool_calls" and calls, answers
        assert all(_valid_call(name, arguments) for name, arguments in calls), calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called(client, stream):
    kwargs = dict(model="tiny-test", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}},
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        [call] = choice.message.tool_calls
        name, arguments = call.function.name, _args(call)
    else:
        name, text = None, ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for piece in chunk.choices[0].delta.tool_calls or ():
                assert piece.index == 0
                name = name or piece.function.name
                text += piece.function.arguments or ""
        arguments = json.loads(text)
    assert name == "get_time" and _valid_call("get_time", arguments), arguments


def test_round_trip_with_a_tool_message(client):
    first = client.chat.completions.create(model="tiny-test", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False,
                                           max_tokens=120, temperature=0,
                                           extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": "22 C and sunny"} for c in message.tool_calls)]
    second = client.chat.completions.create(model="tiny-test", messages=history, tools=TOOLS, max_tokens=6,
                                            temperature=0)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_choice_none_leaves_the_text_alone(client):
    answer = client.chat.completions.create(model="tiny-test", messages=ASK, tools=TOOLS, tool_choice="none",
                                            max_tokens=200, temperature=0,
                                            extra_body={"guided_regex": _literal(CALL_TEXT)})
    assert answer.choices[0].message.content == CALL_TEXT and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages"),
])
def test_malformed_tools_are_a_400_naming_the_field(served, extra, field):
    _, server = served
    body = {"messages": ASK, "max_tokens": 4, **extra}
    response = post(server, "/v1/chat/completions", body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.json()


def test_a_template_without_tools_is_refused(served, monkeypatch):
    engine, server = served
    plain = "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}\n{%- endfor -%}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", plain)
    response = post(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 4},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


# Llama 3.x's JSON calls, behind a <|python_tag|> (made by a regex: the tiny model has Qwen's vocabulary).
LLAMA3_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}; '
               '{"name": "get_time", "parameters": {"zone": 2}}')


@pytest.fixture(scope="module")
def llama3_client(served):
    """A server with --tool-call-parser llama3_json, on the same engine."""
    with ServerThread(build_app(served[0], MODEL_NAME, api_key=KEY, tool_call_parser="llama3_json")) as server:
        yield openai_client(server, KEY)


def test_llama3_json_parses_the_models_tool_calls(llama3_client):
    kwargs = dict(model="tiny-test", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"regex": _literal(LLAMA3_TEXT)}})
    with ThreadPoolExecutor(2) as pool:  # whole and streamed at once
        whole = pool.submit(llama3_client.chat.completions.create, **kwargs)
        streamed = pool.submit(lambda: _collect(llama3_client.chat.completions.create(**kwargs, stream=True)))
        choice, (content, calls, finish) = whole.result().choices[0], streamed.result()
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, _args(c)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": 2})]
    assert content == "" and finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
