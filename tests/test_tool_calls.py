"""Tool calling (Qwen2.5's <tool_call> format) through the official openai client: the chat template renders the
tools, the tool calls and the tool results; auto output is parsed (whole and streamed alike), required and named
choices are enforced by a grammar; malformed tools and tool_choice are a 400 naming the field."""

from __future__ import annotations

import json
import random

import openai
import pytest

from mini_infer.entrypoints.openai.tools import ToolChoice, ToolStream, merge
from mini_infer.factory.tokenizer import CHAT_TEMPLATE
from tests.test_server import post, start

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
    engine, server = start(tiny_model_dir, api_key=KEY)
    with server:
        yield engine, server
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY)


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
    stream = client.chat.completions.create(model="tiny-test", messages=ASK, tools=TOOLS, max_tokens=200,
                                            temperature=0, stream=True,
                                            extra_body={"guided_regex": _literal(CALL_TEXT)})
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": 2})]


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
        pieces, finish = {}, None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for piece in chunk.choices[0].delta.tool_calls or ():
                entry = pieces.setdefault(piece.index, [piece.function.name, ""])
                entry[1] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = [(name, json.loads(arguments)) for name, arguments in pieces.values()]
    assert finish == "tool_calls" and calls
    assert all(_valid_call(name, arguments) for name, arguments in calls), calls


def test_required_yields_a_tool_call_at_temperature_one_with_any_whitespace(client):
    """The grammar's whitespace is bounded by default: sampled at temperature 1 within 80 tokens, every answer of
    a batch is a tool call (unbounded, a random model spent its tokens on whitespace inside the array)."""
    for seed in range(4):
        choice = client.chat.completions.create(model="tiny-test", messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=80, temperature=1.0, seed=seed,
                                                parallel_tool_calls=False).choices[0]  # (else: calls till the end)
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        assert _valid_call(call.function.name, _args(call)), call


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
