"""Bad input fails alone (issue 13): each malformed request found by trying the server as a hostile client would
gets a 4xx naming its field, the engine keeps serving, and nothing is left behind; plus a fuzz test of both
endpoints over the request schema."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_infer import LLM, LLMEngine, SamplingParams
from mini_infer.engine.async_engine import AsyncLLMEngine
from mini_infer.engine.metrics import EngineMetrics
from mini_infer.engine.stop import find_stop_string
from mini_infer.entrypoints.openai.api_server import build_app
from mini_infer.runner.plan import NewRequest
from mini_infer.runner.sampler import Sampler
from test_server import ENGINE_ARGS, MODEL_NAME, ServerThread

GOOD = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
FUZZ_COUNT = {"requests": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    # max_model_len bounds a request that asks for no max_tokens (up to the context limit: the fuzz draws null): at
    # the model's 4,096 positions such a float64 request outlasted the client's 60 s timeout.
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS, max_model_len=512),
                            EngineMetrics(MODEL_NAME))
    with ServerThread(build_app(engine, MODEL_NAME, api_key="k", max_body_bytes=256 * 1024)) as server:
        yield engine, server
    engine.shutdown()


def call(server, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body)  # bytes: sent as they are
    return httpx.post(server.url + path, content=raw, timeout=60,
                      headers={"Authorization": "Bearer k", "Content-Type": "application/json"})


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error


def assert_serving(engine, server) -> None:
    """A good request still succeeds, and nothing of the earlier ones is left in the engine."""
    assert call(server, "/v1/completions", GOOD).status_code == 200
    assert engine.healthy and httpx.get(server.url + "/health").status_code == 200
    assert not engine.engine.has_unfinished_requests() and engine.engine.kv_cache_usage() == 0


# ---- 1. top_k beyond int64 ----

def test_top_k_past_int64_is_clamped_to_the_vocabulary(served, tiny_model_dir):
    engine, server = served
    huge = {"prompt": "Hello", "top_k": 9223372036854775808, "temperature": 1, "max_tokens": 3, "seed": 1}
    assert call(server, "/v1/completions", huge).status_code == 200
    assert_serving(engine, server)
    llm = LLM(str(tiny_model_dir), **ENGINE_ARGS)
    params = SamplingParams(temperature=1.0, top_k=2**63, max_tokens=3, seed=1)
    unlimited = SamplingParams(temperature=1.0, top_k=-1, max_tokens=3, seed=1)
    [out] = llm.generate(["Hello"], params, use_tqdm=False)
    assert out.outputs[0].token_ids == llm.generate(["Hello"], unlimited, use_tqdm=False)[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()


# ---- 2. lone surrogates ----

def test_lone_surrogate_in_prompt_or_messages_is_a_400_naming_the_field(served):
    engine, server = served
    assert_error(call(server, "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'), 400, "prompt")
    chat = b'{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2}'
    assert_error(call(server, "/v1/chat/completions", chat), 400, "messages")
    parts = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 2}'
    assert_error(call(server, "/v1/chat/completions", parts), 400, "messages")
    assert_serving(engine, server)


def test_offline_batch_with_a_lone_surrogate_fails_with_value_error_and_leaves_nothing(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **ENGINE_ARGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="prompt 1: .*not valid Unicode"):
        llm.generate(["fine", "a\ud800b", "also fine"], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert len(llm.generate(["fine"], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_a_failed_add_of_any_kind_leaves_no_request_behind(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir), **ENGINE_ARGS)
    real = llm.engine.add_request

    def add(request_id, prompt, params=None):
        if prompt == "boom":
            raise RuntimeError("tokenizer crashed")
        real(request_id, prompt, params)

    monkeypatch.setattr(llm.engine, "add_request", add)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        llm.generate(["one", "two", "boom"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


# ---- 3. data parallel: what a replica would refuse, the router refuses ----

@pytest.fixture(scope="module")
def untokenized_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-tokenizer")
    for item in tiny_model_dir.iterdir():
        if item.name != "tokenizer.json":
            shutil.copy(item, path / item.name)
    return path


def test_router_refuses_what_a_replica_would_and_every_replica_keeps_running(untokenized_dir):
    llm = LLM(str(untokenized_dir), data_parallel_size=2, dtype="float32", num_kv_blocks=64)
    try:
        with pytest.raises(ValueError, match="stop needs a tokenizer"):
            llm.generate([[1, 2, 3]], SamplingParams(stop=["x"], max_tokens=2), use_tqdm=False)
        outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]
        assert all(r.process.is_alive() for r in llm.engine.replicas)
    finally:
        llm.engine.shutdown()


def test_a_replica_answers_a_refused_request_alone_and_serves_on(untokenized_dir):
    from mini_infer.engine.replicas import add_or_refuse

    engine = LLMEngine.from_args(str(untokenized_dir), dtype="float32", num_kv_blocks=64)
    [refused] = add_or_refuse(engine, "bad", {"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]))
    assert refused.finished and refused.outputs[0].finish_reason == "abort" and refused.prompt_token_ids == [1, 2]
    assert add_or_refuse(engine, "good", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2)) == []
    assert [o.request_id for o in engine.run_until_done() if o.finished] == ["good"]


# ---- 4. any exception while adding fails that request alone ----

def test_an_unexpected_add_error_fails_that_request_and_the_engine_serves_on(tiny_model_dir):
    inner = LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS)
    real = inner.add_processed

    def add(request_id, processed):
        if processed.text == "boom":  # processed by the server, on a worker thread
            raise TypeError("unexpected")
        real(request_id, processed)

    inner.add_processed = add
    engine = AsyncLLMEngine(inner, EngineMetrics(MODEL_NAME))
    try:
        with ServerThread(build_app(engine, MODEL_NAME)) as server:
            response = httpx.post(server.url + "/v1/completions", json={**GOOD, "prompt": "boom"}, timeout=60)
            assert_error(response, 500)
            streamed = httpx.post(server.url + "/v1/completions", json={**GOOD, "prompt": "boom", "stream": True},
                                  timeout=60)
            assert_error(streamed, 500)
            assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
            assert engine.healthy
    finally:
        engine.shutdown()


# ---- 6. bodies that used to give 500 ----

def test_pathological_json_is_a_400_and_a_bad_model_name_a_404(served):
    engine, server = served
    assert_error(call(server, "/v1/completions", b"[" * 10_000 + b"]" * 10_000), 400)
    deep = b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(call(server, "/v1/completions", deep), 400)
    assert_error(call(server, "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"), 400)
    assert_error(call(server, "/v1/completions", b'{"prompt": "x", "model": "m\\ud800"}'), 404, "model")
    assert_serving(engine, server)


# ---- 8. values that turned into garbage, and loose types ----

def test_tiny_top_p_keeps_the_most_likely_token(served):
    engine, server = served
    body = {"prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1.0}
    greedy = call(server, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    tiny = call(server, "/v1/completions", {**body, "temperature": 1, "top_p": 1e-300, "seed": 3})
    assert tiny.json()["choices"][0]["text"] == greedy


@pytest.mark.parametrize("field, value, param", [
    ("repetition_penalty", 1e-300, "repetition_penalty"),
    ("repetition_penalty", 1e300, "repetition_penalty"),
    ("max_tokens", "10", "max_tokens"),
    ("max_tokens", True, "max_tokens"),
    ("prompt", [True, False], "prompt"),
    ("temperature", "1", "temperature"),
    ("stream", "true", "stream"),
    ("stop_token_ids", [True], "stop_token_ids"),
])
def test_garbage_values_and_loose_types_are_refused(served, field, value, param):
    engine, server = served
    assert_error(call(server, "/v1/completions", {**GOOD, field: value}), 400, param)


def test_an_integer_still_fills_a_float_field(served):
    assert call(served[1], "/v1/completions", {**GOOD, "temperature": 0, "top_p": 1}).status_code == 200


# ---- 9. an empty API key ----

def test_an_empty_api_key_is_refused_at_start(served, tiny_model_dir, monkeypatch, capsys):
    engine, _ = served
    with pytest.raises(ValueError, match="empty"):
        build_app(engine, MODEL_NAME, api_key="")
    from mini_infer.entrypoints.cli import main

    assert main(["serve", "--model", str(tiny_model_dir), "--api-key", ""]) == 2
    assert "--api-key" in capsys.readouterr().err
    monkeypatch.setenv("MINI_INFER_API_KEY", " ")
    assert main(["serve", "--model", str(tiny_model_dir)]) == 2


# ---- 10. from reading the code ----

@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2),
                                    SamplingParams(temperature=1.0, top_p=0.999)])
def test_an_extreme_uniform_draw_cannot_pick_an_impossible_token(monkeypatch, params):
    """torch.rand may return exactly 0.0: the draw must still land on a token of positive probability."""
    sampler = Sampler(4, torch.device("cpu"), seed=0)
    sampler.add(NewRequest("r", 0, [0], 1, 0, [], params, ()))
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(a[0], dtype=torch.float64))
    low = sampler(torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]]), [0]).token_ids
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((a[0],), 1 - 2**-53, dtype=torch.float64))
    high = sampler(torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]]), [0]).token_ids
    assert low in ([1], [2]) and high in ([1], [2])


class _Text:
    """What find_stop_string reads of a detokenizer."""

    def __init__(self, text: str, stops: list[str]) -> None:
        self.output_text, self.stop_strings, self.include_stop = text, stops, False


def test_a_stop_string_is_looked_for_only_where_it_could_end_in_the_new_text():
    # "ab" ended two characters before the new one (say before min_tokens allowed stopping): not this step's,
    # although the longer stop string's look-back would reach it.
    detok = _Text("xxab.c", ["ab", "longstop"])
    assert find_stop_string(detok, 1) is None and detok.output_text == "xxab.c"
    detok = _Text("xxab", ["ab", "longstop"])
    assert find_stop_string(detok, 1) == "ab" and detok.output_text == "xx"


# ---- fuzz: both endpoints over the request schema ----

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                     st.sampled_from(["\ud800", "a\udc00b", "", " "]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=8)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
           "stop_token_ids", "skip_special_tokens", "echo", "best_of", "logit_bias", "response_format", "tools"]
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 7]),
                                            "content": _VALUES}), max_size=3)


@st.composite
def request_bodies(draw):
    """Mostly well-formed bodies with a few fields replaced by anything, sometimes not a JSON object at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_VALUES)
    body = {"prompt": draw(st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 200_000), max_size=5))),
            "messages": draw(_MESSAGES), "max_tokens": draw(st.integers(1, 4)), "stream": draw(st.booleans())}
    for field in draw(st.lists(st.sampled_from(_FIELDS), max_size=4, unique=True)):
        body[field] = draw(_VALUES)
    return body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=request_bodies(), chat=st.booleans())
def test_fuzz_no_5xx_every_4xx_in_openai_shape(served, body, chat):
    engine, server = served
    response = call(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    FUZZ_COUNT["requests"] += 1
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif isinstance(body, dict) and body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
    if FUZZ_COUNT["requests"] % 40 == 0:
        assert_serving(engine, server)


def test_fuzz_tried_enough_requests_and_the_server_still_serves(served):
    """Runs after the fuzz test (file order): it tried its requests, and a good one still succeeds."""
    assert FUZZ_COUNT["requests"] >= 120
    assert_serving(*served)


# ---- 7. tokenizing a long prompt holds no stream up ----

def test_prompts_are_tokenized_off_the_engine_thread(served, monkeypatch):
    engine, server = served
    tokenizer, threads = engine.tokenizer, []
    real = tokenizer.encode

    def encode(text, **kwargs):
        threads.append(threading.current_thread().name)
        return real(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    assert call(server, "/v1/completions", GOOD).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert call(server, "/v1/chat/completions", chat).status_code == 200
    assert len(threads) == 2 and "mini-infer-engine" not in threads


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(tiny_model_dir, monkeypatch):
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)
    processor = engine.processor
    limit = processor._max_prompt_chars
    monkeypatch.setattr(processor.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(ValueError, match="characters, more than max_model_len") as refused:
        processor.process("x" * (limit + 1), SamplingParams(max_tokens=1))
    assert refused.value.field == "prompt"


# ---- soak: mixed traffic with disconnects ----

SOAK_REQUESTS = int(os.environ.get("MINI_INFER_SOAK_REQUESTS", "240"))  # raise it for a longer soak


def test_soak_mixed_requests_with_disconnects(served):
    """Completions and chat, streamed and not, a fifth of the streams dropped after their first chunk and some
    requests cancelled before any answer: every completed one has the usage it asked for, and afterwards the
    engine holds no request and no KV block."""
    engine, server = served
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        chat, stream, n = rng.random() < 0.5, rng.random() < 0.6, rng.randint(1, 6)
        body = {"max_tokens": n, "ignore_eos": True, "temperature": rng.choice([0, 0.8]), "stop": ["é", "\n\n"]}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        body |= ({"messages": [{"role": "user", "content": f"question {i} ✓"}]} if chat else {"prompt": f"text {i}"})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        fate = rng.random()
        if fate < 0.02:  # gone before the first token
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(0)
            task.cancel()
            return "cancelled"
        if not stream:
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            finish = response.json()["choices"][0]["finish_reason"]
            assert usage["completion_tokens"] == n or finish == "stop", (usage, finish)
            return "ok"
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if fate < 0.2:
                        return "dropped"  # leaving the block closes the connection mid-stream
        assert lines[-1] == "[DONE]"
        return "ok"

    async def run_all():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=120,
                                     limits=limits) as client:
            semaphore = asyncio.Semaphore(16)

            async def bounded(i):
                async with semaphore:
                    return await one(client, i)

            return await asyncio.gather(*(bounded(i) for i in range(SOAK_REQUESTS)))

    results = asyncio.run(run_all())
    assert results.count("ok") > SOAK_REQUESTS // 2 and "dropped" in results
    deadline = time.monotonic() + 30
    while engine.engine.has_unfinished_requests() or engine.engine.kv_cache_usage() > 0:
        assert time.monotonic() < deadline, "requests or KV blocks left behind after the soak"
        time.sleep(0.05)
    assert_serving(engine, server)


# ---- 10. a client gone before its first token ----

def test_a_disconnect_before_the_first_token_aborts_during_prefill(tiny_model_dir):
    """Steps slowed down and a prompt prefilled in small chunks: the client leaves long before its first token,
    and the request is aborted with most of its prompt still to compute."""
    inner = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    real_step, real_abort, computed_at_abort = inner.step, inner.abort_request, []

    def slow_step():
        time.sleep(0.2)
        return real_step()

    def abort(request_id):
        computed_at_abort.extend(inner.requests[r].num_computed_tokens for r in [request_id] if r in inner.requests)
        real_abort(request_id)

    inner.step, inner.abort_request = slow_step, abort
    engine = AsyncLLMEngine(inner, EngineMetrics(MODEL_NAME))
    try:
        with ServerThread(build_app(engine, MODEL_NAME)) as server:
            prompt = list(range(1, 201))  # 25 chunks of 8 tokens: ~5 s to the first token
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=0.6)
            deadline = time.monotonic() + 10
            while not computed_at_abort:
                assert time.monotonic() < deadline, "the request was not aborted"
                time.sleep(0.05)
            assert computed_at_abort[0] < len(prompt) // 2
    finally:
        engine.shutdown()


# ---- 4. a step that fails ends every open stream cleanly ----

def test_a_failing_step_ends_every_open_stream_with_an_error_event_and_done(tiny_model_dir):
    inner = LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS)
    engine = AsyncLLMEngine(inner, EngineMetrics(MODEL_NAME))
    real_step, broken = inner.step, threading.Event()

    def step():
        if broken.is_set():
            raise RuntimeError("simulated device failure")
        return real_step()

    inner.step = step
    body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with ServerThread(build_app(engine, MODEL_NAME)) as server:
            events = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        broken.set()  # after the first chunk
            assert events[-1] == "[DONE]" and "simulated device failure" in json.loads(events[-2])["error"]["message"]
            assert httpx.get(server.url + "/health").status_code == 503
    finally:
        engine.shutdown()
