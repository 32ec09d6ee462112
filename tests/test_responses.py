"""The Responses API (/v1/responses) through the official openai client: text and streamed events, a tool round trip
(with the whole history and with previous_response_id), text.format json_schema, the store (GET, DELETE), reasoning
items, and bad input as a 400 naming the field while the server serves on."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mini_infer.entrypoints.openai.reasoning import ReasoningStream
from mini_infer.entrypoints.openai.responses import ResponseOutput, input_messages
from mini_infer.entrypoints.openai.tools import ToolChoice
from tests.test_server import MODEL_NAME, post, serving, wait_for
from tests.test_server import client as openai_client

KEY = "sk-responses"

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Rome"]}}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving(tiny_model_dir, api_key=KEY) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1], KEY)


def _headers() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def test_a_text_response_is_the_chat_answer(client):
    response = client.responses.create(model=MODEL_NAME, input="Hello there", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert [item.type for item in response.output] == ["message"]


def test_the_stream_builds_what_the_whole_response_holds(client):
    args = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}],
                max_output_tokens=12, temperature=0)
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert events[-1].response.status == whole.status
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    with client.responses.stream(**args) as stream:  # the client's strict helper: order, ids, required fields
        assert stream.get_final_response().output_text == whole.output_text


def test_a_tool_round_trip_with_history_or_previous_response_id(client):
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    first = client.responses.create(model=MODEL_NAME, input=ask, tools=[WEATHER], max_output_tokens=60, temperature=1,
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C, sunny"}
    # The whole history sent back, or only the result after the stored response: the same prompt either way.
    history = [*ask, *[item.model_dump(exclude_none=True) for item in first.output], result]
    again = client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER], max_output_tokens=6,
                                    temperature=0)
    chained = client.responses.create(model=MODEL_NAME, input=[result], previous_response_id=first.id,
                                      tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == again.usage.input_tokens
    assert chained.output_text == again.output_text


def test_text_format_json_schema_closes_as_valid_json(client):
    for _ in range(3):
        response = client.responses.create(
            model=MODEL_NAME, input="A person, as JSON", max_output_tokens=80, temperature=1,
            text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}})
        value = json.loads(response.output_text)
        assert set(value) == {"name", "age", "ok"} and isinstance(value["ok"], bool)


def test_the_store_gets_and_deletes(served, client):
    response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3, temperature=0)
    fetched = client.responses.retrieve(response.id)
    assert fetched.output_text == response.output_text and fetched.id == response.id
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3, store=False)
    reply = httpx.get(f"{served[1].url}/v1/responses/{unstored.id}", headers=_headers(), timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": 5}, "input"),
])
def test_bad_input_is_a_4xx_naming_the_field(served, body, param):
    reply = post(served[1], "/v1/responses", body, _headers())
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert post(served[1], "/v1/responses", {"input": "still serving", "max_output_tokens": 1},
                _headers()).status_code == 200


def test_hosted_tools_are_not_offered_to_the_model(client):
    response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, temperature=0,
                                       tools=[{"type": "web_search"}])
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens == plain.usage.input_tokens
    assert [tool.type for tool in response.tools] == ["web_search"]


def test_input_items_become_chat_messages():
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules"}]},
             {"role": "user", "content": "Go"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]
    assert input_messages(items) == [
        {"role": "system", "content": "Rules"}, {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "Calling", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def _replay(events: list[dict]) -> list[dict]:
    """The output items a client assembles from the stream's events."""
    items: list[dict] = []
    for event in events:
        if event["type"] == "response.output_item.added":
            assert event["output_index"] == len(items)
            items.append(json.loads(json.dumps(event["item"])))
        elif event["type"] == "response.content_part.added":
            items[event["output_index"]]["content"].append(dict(event["part"]))
        elif event["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[event["output_index"]]["content"][event["content_index"]]["text"] += event["delta"]
        elif event["type"] == "response.function_call_arguments.delta":
            items[event["output_index"]]["arguments"] += event["delta"]
        elif event["type"] == "response.output_item.done":
            items[event["output_index"]]["status"] = event["item"]["status"]
            assert items[event["output_index"]] == event["item"]
    return items


@pytest.mark.parametrize("parser, tools", [("qwen3", None), ("qwen3", "auto"), (None, "auto")])
def test_output_items_in_the_order_written_and_the_events_build_them(parser, tools):
    text = ('<think>\nplan it\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Rome"}}\n</tool_call>')
    output = ResponseOutput(parser, ToolChoice(tools) if tools else None, "hermes")
    events = [e for i in range(0, len(text), 5) for e in output.feed(text[i:i + 5], 1, i + 5 >= len(text))]
    assert _replay(events) == output.items
    kinds = [item["type"] for item in output.items]
    reasoning, content = ReasoningStream(parser).feed(text, True) if parser else ("", text)
    assert kinds == (["reasoning"] if parser else []) + ["message"] + (["function_call"] if tools else [])
    if parser:
        assert output.items[0]["content"][0]["text"] == reasoning
        assert output.reasoning_tokens > 0
    message = output.items[kinds.index("message")]["content"][0]["text"]
    assert message == (content[: content.index("<tool_call>")].rstrip() if tools else content)
    if tools:
        assert json.loads(output.items[-1]["arguments"]) == {"city": "Rome"}
    assert all(item["status"] == "completed" for item in output.items)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_mid_response_frees_its_blocks(served, stream):
    engine, server = served
    body = {"input": "tell me a long story", "max_output_tokens": 3000, "stream": stream}
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", server.url + "/v1/responses", json=body, headers=_headers()) as response:
                lines = response.iter_lines()
                assert next(lines) == "event: response.created"
                wait_for(lambda: engine.engine.kv_cache_usage() > 0)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.url + "/v1/responses", json=body, headers=_headers(), timeout=1.0)
    wait_for(lambda: engine.engine.kv_cache_usage() == 0 and not engine.engine.has_unfinished_requests())
    assert post(server, "/v1/responses", {"input": "still there?", "max_output_tokens": 2},
                _headers()).status_code == 200
