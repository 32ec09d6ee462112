"""Reasoning models: the qwen3 and deepseek_r1 parsers split <think> text off the answer exactly at the tags,
streamed (in any chunking) as whole; chat completions return it as reasoning_content; chat_template_kwargs and
--chat-template reach the template; the qwen3 preset's template has the thinking switch."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.entrypoints.openai.api_server import load_chat_template
from mini_infer.entrypoints.openai.reasoning import ReasoningStream
from tests.test_server import ENGINE_ARGS, post, serving
from tests.test_server import client as openai_client
from tests.test_tool_calls import _literal

KEY = "sk-reasoning"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
THOUGHT = "\nRayleigh scattering: short waves scatter more.\n"
ANSWER = "\n\nBecause blue light scatters most."


def _split(parser: str, text: str) -> tuple[str, str]:
    return ReasoningStream(parser).feed(text, final=True)


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>a</think>b", ("a", "b")),
    ("qwen3", "<think>\nx\n</think>\n\ny</think>z", ("\nx\n", "\n\ny</think>z")),  # split at the first end tag
    ("qwen3", "plain answer", ("", "plain answer")),  # thinking off: no leading tag
    ("qwen3", " <think>a</think>b", ("", " <think>a</think>b")),  # the tag must open the output
    ("qwen3", "<think>cut while thinking", ("cut while thinking", "")),
    ("qwen3", "<thi", ("", "<thi")),  # a tag's beginning that the output ends in is text
    ("deepseek_r1", "thought</think>answer", ("thought", "answer")),  # the prompt opened the thinking
    ("deepseek_r1", "<think>thought</think>answer", ("thought", "answer")),
    ("deepseek_r1", "all thinking", ("all thinking", "")),
    ("deepseek_r1", "", ("", "")),
])
def test_the_split_is_exact_at_the_tags(parser, text, expected):
    assert _split(parser, text) == expected


@settings(max_examples=150, deadline=None)
@given(parser=st.sampled_from(["qwen3", "deepseek_r1"]),
       parts=st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "a", "\n", " b"]),
                      max_size=12),
       cuts=st.lists(st.integers(0, 80), max_size=6))
def test_streamed_pieces_join_to_the_whole_split(parser, parts, cuts):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] or [len(text)])):
        r, c = stream.feed(text[a:b], final=i == len(bounds) - 2 or len(bounds) == 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == _split(parser, text)


def test_the_qwen3_template_has_the_thinking_switch(qwen3_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_model_dir))
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]  # Qwen3's ids
    thinking = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    off = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == thinking + "<think>\n\n</think>\n\n"
    # An assistant turn after the last user turn keeps its reasoning; an earlier one drops it.
    history = [*ASK, {"role": "assistant", "reasoning_content": "old", "content": "A"},
               {"role": "user", "content": "More?"}, {"role": "assistant", "reasoning_content": "new", "content": "B"}]
    text = tokenizer.apply_chat_template(history, tokenize=False)
    assert "<|im_start|>assistant\nA<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew\n</think>\n\nB<|im_end|>" in text


@pytest.fixture(scope="module")
def served(qwen3_model_dir):
    with serving(qwen3_model_dir, api_key=KEY, reasoning_parser="qwen3") as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1], KEY)


def _forced(text: str, **extra) -> dict:
    """Chat arguments that make the random model write exactly `text` (a regex constraint), greedily."""
    return dict(model=None, messages=ASK, temperature=0, max_tokens=60,
                extra_body={"structured_outputs": {"regex": _literal(text)}, **extra})


@pytest.mark.parametrize("thought", [THOUGHT, ""])
def test_chat_returns_reasoning_content_apart_streamed_and_not(client, thought):
    text = f"<think>{thought}</think>{ANSWER}"
    whole = client.chat.completions.create(**_forced(text)).choices[0]
    assert whole.message.reasoning_content == (thought or None)
    assert whole.message.content == ANSWER
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**_forced(text), stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (thought, ANSWER)


def test_an_answer_without_thinking_is_all_content(client):
    message = client.chat.completions.create(**_forced("just this")).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "just this")


def test_chat_template_kwargs_reach_the_template(served):
    server = served[1]
    headers = {"Authorization": f"Bearer {KEY}"}
    on = post(server, "/tokenize", {"messages": ASK}, headers).json()
    off = post(server, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
               headers).json()
    assert off["tokens"][: on["count"]] == on["tokens"]
    assert off["tokens"][on["count"]:] == [151667, 271, 151668, 271]  # <think>\n\n</think>\n\n
    client = openai_client(server, KEY)
    answer = client.chat.completions.create(model=None, messages=ASK, max_tokens=3, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.usage.prompt_tokens == off["count"]


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False}, "yes"])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(served, kwargs):
    reply = post(served[1], "/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": kwargs},
                 {"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "chat_template_kwargs"
    assert post(served[1], "/v1/chat/completions", {"messages": ASK, "max_tokens": 1},
                {"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_chat_template_option_replaces_the_tokenizers(qwen3_model_dir, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    assert load_chat_template(str(path)) == path.read_text(encoding="utf-8")
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with serving(qwen3_model_dir, chat_template=load_chat_template(str(path))) as (_, server):
        reply = httpx.post(server.url + "/tokenize", json={"messages": ASK, "return_token_strs": True}, timeout=60)
        text = httpx.post(server.url + "/detokenize", json={"tokens": reply.json()["tokens"]}, timeout=60).json()
    assert text["prompt"] == "[user] Why is the sky blue?\n"


def test_llm_chat_takes_template_kwargs(qwen3_model_dir):
    from mini_infer import LLM, SamplingParams

    llm = LLM(str(qwen3_model_dir), **ENGINE_ARGS)
    params = SamplingParams(max_tokens=2, temperature=0)
    on, off = (llm.chat(ASK, params, use_tqdm=False, chat_template_kwargs=kwargs)[0] for kwargs in
               (None, {"enable_thinking": False}))
    assert off.prompt_token_ids == on.prompt_token_ids + [151667, 271, 151668, 271]
