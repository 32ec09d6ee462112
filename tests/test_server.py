"""The OpenAI-compatible server on a free loopback port, tiny random model: the official `openai` client,
concurrent streaming against offline LLM.generate, disconnects, every error case, /metrics."""

from __future__ import annotations

import contextlib

import asyncio
import json
import socket
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mini_infer import LLM, LLMEngine
from mini_infer.engine.async_engine import AsyncLLMEngine
from mini_infer.engine.metrics import EngineMetrics
from mini_infer.entrypoints.openai.api_server import build_app

API_KEY = "test-key"
MODEL_NAME = "tiny-test"
# float64: greedy outputs are compared with offline generation, and fp32 could flip near-ties.
ENGINE_ARGS = dict(dtype="float64", num_kv_blocks=512, max_num_seqs=64)


class ServerThread:
    """uvicorn serving an app on a free loopback port from a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def start(model_dir, engine_args: dict | None = None, **app_args):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(model_dir), **ENGINE_ARGS, **(engine_args or {})),
                            EngineMetrics(MODEL_NAME))
    return engine, ServerThread(build_app(engine, MODEL_NAME, **app_args))


@contextlib.contextmanager
def serving(model_dir, engine_args: dict | None = None, **app_args):
    """(engine, server) of start() for the block: the server running, the engine shut down after."""
    engine, server = start(model_dir, engine_args, **app_args)
    try:
        with server:
            yield engine, server
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving(tiny_model_dir, api_key=API_KEY, max_body_bytes=64 * 1024) as pair:
        yield pair


@pytest.fixture(scope="module")
def served_ahead(tiny_model_dir):
    """The server over an engine that schedules each step before the last one's update (async scheduling, a GPU's
    default)."""
    with serving(tiny_model_dir, dict(async_scheduling=True), api_key=API_KEY) as pair:
        yield pair


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), **ENGINE_ARGS)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def post(server, path: str, body, headers=None, **kwargs) -> httpx.Response:
    headers = {**auth(), **(headers or {})}
    if isinstance(body, (dict, list)):
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kwargs)
    return httpx.post(server.url + path, content=body, headers=headers, timeout=60, **kwargs)


def metric_samples(server) -> dict:
    """{(name, frozenset(labels minus model_name)): value} from /metrics, parsed by prometheus_client."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            samples[(s.name, labels)] = s.value
    return samples


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def prompts(n: int) -> list[str]:
    words = ["alpha", "river", "stone", "cloud", "ember", "maple", "quartz", "violet"]
    return [" ".join(words[(i + j) % len(words)] for j in range(1 + i % 7)) + f" {i}" for i in range(n)]


def greedy_offline(offline, prompt, max_tokens: int):
    params = replace(offline.get_default_sampling_params(), temperature=0.0, max_tokens=max_tokens)
    return offline.generate([prompt], params, use_tqdm=False)[0]


# ---- the official openai client ----

def client(server, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


def test_openai_client_completions(served, offline):
    _, server = served
    expected = greedy_offline(offline, "The capital of France", 6)
    out = client(server).completions.create(model=MODEL_NAME, prompt="The capital of France", max_tokens=6,
                                            temperature=0)
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 6 and out.usage.total_tokens == out.usage.prompt_tokens + 6

    stream = client(server).completions.create(model=MODEL_NAME, prompt="The capital of France", max_tokens=6,
                                               temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_openai_client_token_id_prompt_and_logprobs(served, offline):
    _, server = served
    ids = offline.get_tokenizer().encode("one two three")
    # No repetition penalty (the model's generation_config has one): then greedy picks the top logprob.
    params = replace(offline.get_default_sampling_params(), temperature=0.0, max_tokens=4, repetition_penalty=1.0)
    expected = offline.generate([ids], params, use_tqdm=False)[0]
    out = client(server).completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, logprobs=2,
                                            extra_body={"repetition_penalty": 1.0})
    assert out.choices[0].text == expected.outputs[0].text
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs):
        assert lp == max(top.values())  # greedy: the sampled token is the most likely one
        assert 2 <= len(top) <= 3
    assert out.usage.prompt_tokens == len(ids)


def test_openai_client_chat(served, offline):
    _, server = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    expected = offline.chat(messages, replace(offline.get_default_sampling_params(), temperature=0.0,
                                              max_tokens=5), use_tqdm=False)[0]
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert [len(t.top_logprobs) for t in choice.logprobs.content] == [3] * out.usage.completion_tokens

    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])

    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True})
    counted = [c.usage.completion_tokens for c in stream]  # every chunk: the tokens streamed so far
    assert counted[0] == 0 and counted[-2:] == [5, 5] and counted == sorted(counted)


def test_a_list_of_prompts_gets_n_choices_each_indexed_as_openai(served, offline):
    """OpenAI's batch: prompt k's choice j is choice k * n + j, each what that prompt alone gives (greedy), the
    usage summed; streamed and not; token-id prompts too."""
    _, server = served
    texts = prompts(3)
    expected = [greedy_offline(offline, p, 4) for p in texts]
    body = {"prompt": texts, "max_tokens": 4, "temperature": 0, "n": 2}
    answer = post(server, "/v1/completions", body).json()
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    assert [c["text"] for c in answer["choices"]] == [e.outputs[0].text for e in expected for _ in range(2)]
    assert answer["usage"]["prompt_tokens"] == sum(len(e.prompt_token_ids) for e in expected)
    assert answer["usage"]["completion_tokens"] == 6 * 4
    ids = post(server, "/v1/completions", {**body, "prompt": [e.prompt_token_ids for e in expected]}).json()
    assert [c["text"] for c in ids["choices"]] == [c["text"] for c in answer["choices"]]
    streamed = {}
    for chunk in client(server).completions.create(model=MODEL_NAME, **body, stream=True,
                                                   stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        usage = chunk.usage
    assert [streamed[i] for i in range(6)] == [c["text"] for c in answer["choices"]]
    assert usage.completion_tokens == 24 and usage.prompt_tokens == answer["usage"]["prompt_tokens"]


def test_a_bad_prompt_in_a_list_fails_the_request_alone(served):
    engine, server = served
    refused = post(server, "/v1/completions", {"prompt": ["fine", [151936]], "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    assert post(server, "/v1/completions", {"prompt": ["fine", "also fine"], "max_tokens": 2}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": ["x"] * 257, "max_tokens": 1}).status_code == 400
    assert engine.engine.kv_cache_usage() == 0.0


def test_models_and_health(served):
    _, server = served
    assert [m.id for m in client(server).models.list()] == [MODEL_NAME]
    assert client(server).models.retrieve(MODEL_NAME).id == MODEL_NAME
    missing = httpx.get(server.url + "/v1/models/no-such-model", headers={"Authorization": f"Bearer {API_KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/health").status_code == 200


# ---- concurrency ----

@pytest.mark.parametrize("server_fixture", ["served", "served_ahead"])
def test_32_concurrent_streams_match_offline_generation(request, server_fixture, offline):
    _, server = request.getfixturevalue(server_fixture)
    texts = prompts(32)
    lengths = [3 + i % 6 for i in range(32)]
    expected = [greedy_offline(offline, p, n) for p, n in zip(texts, lengths)]

    async def one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(pieces), usage

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(texts, lengths)))

    results = asyncio.run(run_all())
    for (text, usage), want in zip(results, expected):
        assert text == want.outputs[0].text
        assert usage.completion_tokens == len(want.outputs[0].token_ids)
        assert usage.prompt_tokens == len(want.prompt_token_ids)


# ---- disconnects ----

@pytest.mark.parametrize("server_fixture", ["served", "served_ahead"])
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(request, server_fixture, stream):
    engine, server = request.getfixturevalue(server_fixture)
    before = metric_samples(server)[("mini_infer:request_success_total", frozenset({("finished_reason", "abort")}))]
    body = {"prompt": "tell me a long story", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", server.url + "/v1/completions", json=body, headers=auth()) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                wait_for(lambda: engine.engine.kv_cache_usage() > 0)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=1.0)
    wait_for(lambda: engine.engine.kv_cache_usage() == 0 and not engine.engine.has_unfinished_requests())
    wait_for(lambda: metric_samples(server)[("mini_infer:kv_cache_usage_perc", frozenset())] == 0)
    after = metric_samples(server)
    assert after[("mini_infer:request_success_total", frozenset({("finished_reason", "abort")}))] == before + 1
    assert after[("mini_infer:num_requests_running", frozenset())] == 0
    assert post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 2}).status_code == 200


# ---- errors ----

TOO_LONG = {"prompt": "hello", "max_tokens": 5000}

ERROR_CASES = {
    "malformed json": (b'{"prompt": "x", ', {}, 400, None),
    "not an object": (b'[1, 2]', {}, 400, None),
    "wrong type": ({"prompt": "x", "max_tokens": "many"}, {}, 400, "max_tokens"),
    "missing prompt": ({"max_tokens": 3}, {}, 400, "prompt"),
    "top_p out of range": ({"prompt": "x", "top_p": 1.5}, {}, 400, "top_p"),
    "temperature negative": ({"prompt": "x", "temperature": -1}, {}, 400, "temperature"),
    "n above 128": ({"prompt": "x", "n": 129}, {}, 400, "n"),
    "logprobs too many": ({"prompt": "x", "logprobs": 50}, {}, 400, "logprobs"),
    "suffix": ({"prompt": "x", "suffix": "y"}, {}, 400, "suffix"),
    "logit_bias key not an id": ({"prompt": "x", "logit_bias": {"hello": 1}}, {}, 400, "logit_bias"),
    "logit_bias key not ascii": ({"prompt": "x", "logit_bias": {"\u0663": 1}}, {}, 400, "logit_bias"),
    "logit_bias id out of vocab": ({"prompt": "x", "logit_bias": {"999999999": 1}}, {}, 400, "logit_bias"),
    "logit_bias value out of range": ({"prompt": "x", "logit_bias": {"5": 101}}, {}, 400, "logit_bias"),
    "logit_bias value not a number": ({"prompt": "x", "logit_bias": {"5": "up"}}, {}, 400, "logit_bias"),
    "token id out of vocab": ({"prompt": [1, 10**9]}, {}, 400, "prompt"),
    "over max_model_len": (TOO_LONG, {}, 400, "max_tokens"),
    "unknown model": ({"prompt": "x", "model": "gpt-17"}, {}, 404, "model"),
    "missing api key": ({"prompt": "x"}, {"Authorization": ""}, 401, None),
    "wrong api key": ({"prompt": "x"}, {"Authorization": "Bearer nope"}, 401, None),
    "body too large": (json.dumps({"prompt": "x" * 100_000}).encode(), {}, 413, None),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_error_cases(served, case):
    engine, server = served
    body, headers, status, param = ERROR_CASES[case]
    response = post(server, "/v1/completions", body, headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == status
    if case == "over max_model_len":
        assert "max_model_len (4096)" in error["message"]
    ok = post(server, "/v1/completions", {"prompt": "after an error", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert engine.engine.kv_cache_usage() == 0


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
])
def test_chat_error_cases(served, body, param):
    _, server = served
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_logit_bias_through_both_endpoints_matches_offline(served, offline):
    _, server = served
    tokenizer = offline.get_tokenizer()
    forced = tokenizer.encode(" river", add_special_tokens=False)[0]
    body = {"prompt": "The capital of France", "max_tokens": 4, "temperature": 0, "logit_bias": {str(forced): 100}}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    expected = replace(offline.get_default_sampling_params(), temperature=0.0, max_tokens=4,
                       logit_bias={forced: 100.0})
    offline_out = offline.generate(["The capital of France"], expected, use_tqdm=False)[0].outputs[0]
    assert offline_out.token_ids == [forced] * 4
    assert response.json()["choices"][0]["text"] == offline_out.text
    chat = client(served[1]).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 3)


def test_openai_client_n_choices(served, offline):
    _, server = served
    expected = greedy_offline(offline, "The capital of France", 4).outputs[0].text
    chat = client(server).chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                  n=2, max_tokens=4, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 8
    stream = client(server).completions.create(model=MODEL_NAME, prompt="The capital of France", n=3, max_tokens=4,
                                               temperature=0, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: expected, 1: expected, 2: expected}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_prepends_the_prompt_and_its_logprobs(served, offline, stream):
    _, server = served
    prompt = "The capital of France"
    expected = greedy_offline(offline, prompt, 4)
    params = replace(offline.get_default_sampling_params(), temperature=0.0, max_tokens=4, prompt_logprobs=2)
    reference = offline.generate([prompt], params, use_tqdm=False)[0]
    out = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, stream=stream)
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert text == prompt + expected.outputs[0].text
    num_prompt = len(expected.prompt_token_ids)
    assert len(tokens) == num_prompt + 4 and values[0] is None
    tokenizer = offline.get_tokenizer()
    assert "".join(tokens[:num_prompt]) == prompt == tokenizer.decode(expected.prompt_token_ids)
    for position in range(1, num_prompt):
        token_id = expected.prompt_token_ids[position]
        assert values[position] == pytest.approx(reference.prompt_logprobs[position][token_id].logprob, abs=1e-9)
    plain = post(server, "/v1/completions", {"prompt": [9707, 11], "max_tokens": 2, "temperature": 0, "echo": True})
    assert plain.json()["choices"][0]["text"].startswith(tokenizer.decode([9707, 11]))


def test_tokenize_and_detokenize(served, offline):
    _, server = served
    tokenizer = offline.get_tokenizer()
    text = "Hello, world! The capital of France"
    response = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
    detok = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert detok.status_code == 200 and detok.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**12]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_bodies_naming_the_field(served, path, body, param):
    _, server = served
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_route_and_open_endpoints(served):
    _, server = served
    response = httpx.get(server.url + "/v1/nothing", headers=auth())
    assert response.status_code == 404 and response.json()["error"]["code"] == 404
    assert httpx.get(server.url + "/v1/models").status_code == 401  # /v1 needs the key
    assert httpx.get(server.url + "/metrics").status_code == 200  # /health and /metrics do not


def test_engine_failure_gives_500_and_unhealthy(tiny_model_dir):
    engine, server = start(tiny_model_dir)
    with server:
        assert post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 2}).status_code == 200

        def broken_step():
            raise RuntimeError("simulated device failure")

        engine.engine.step = broken_step
        response = post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 2})
        assert response.status_code == 500
        assert "simulated device failure" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        again = post(server, "/v1/completions", {"prompt": "again", "max_tokens": 2})
        assert again.status_code == 500 and again.json()["error"]["type"] == "internal_server_error"
    engine.shutdown()


# ---- metrics ----

def test_metrics_count_the_requests_sent(tiny_model_dir):
    engine, server = start(tiny_model_dir)
    with server:
        sent = [("a b c", 3), ("d e", 5), ("the quick brown fox", 4)]
        usages = []
        for prompt, n in sent:
            response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": n, "ignore_eos": True})
            usages.append(response.json()["usage"])
        stopped = post(server, "/v1/completions", {"prompt": "zz", "max_tokens": 50, "temperature": 0,
                                                   "stop_token_ids": list(range(151643))})  # stops at once
        assert stopped.json()["choices"][0]["finish_reason"] == "stop"
        usages.append(stopped.json()["usage"])
        assert post(server, "/v1/completions", {"prompt": "x", "top_p": 5}).status_code == 400  # refused: uncounted
        repeated = " ".join(["river stone cloud"] * 12)  # 36+ tokens: two full blocks of 16 cached the second time
        for _ in range(2):
            usages.append(post(server, "/v1/completions", {"prompt": repeated, "max_tokens": 1}).json()["usage"])
        samples = metric_samples(server)
        kv = engine.engine.kv_cache
    engine.shutdown()

    def value(name, **labels):
        return samples[(name, frozenset(labels.items()))]

    assert value("mini_infer:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value("mini_infer:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert value("mini_infer:prefix_cache_queries_total") == kv.prefix_queries == sum(u["prompt_tokens"]
                                                                                       for u in usages)
    assert value("mini_infer:prefix_cache_hits_total") == kv.prefix_hits >= 32
    # each request's usage says how many of its prompt tokens the cache held: the repeated prompt's second time
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert sum(cached) == kv.prefix_hits and cached[-2] == 0 and cached[-1] >= 32
    assert value("mini_infer:request_success_total", finished_reason="length") == 5
    assert value("mini_infer:request_success_total", finished_reason="stop") == 1
    assert value("mini_infer:request_success_total", finished_reason="abort") == 0
    assert value("mini_infer:time_to_first_token_seconds_count") == 6
    assert value("mini_infer:e2e_request_latency_seconds_count") == 6
    assert value("mini_infer:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    assert value("mini_infer:num_requests_running") == value("mini_infer:num_requests_waiting") == 0
    assert value("mini_infer:kv_cache_usage_perc") == 0
    assert value("mini_infer:num_preemptions_total") == 0


# ---- bench-serve ----

@pytest.mark.parametrize("rate", ["inf", "200"])
def test_bench_serve_reports_every_level(served, tmp_path, rate):
    from mini_infer.bench.cli import build_parser
    from mini_infer.bench.serve import ServeOptions, sample_requests
    from mini_infer.entrypoints.cli import main

    _, server = served
    argv = ["bench-serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
            "--max-concurrency", "1,3", "--input-len", "8", "--output-len", "4", "--request-rate", rate,
            "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    options = ServeOptions.from_args(build_parser().parse_args(argv))
    assert [level["max_concurrency"] for level in report["levels"]] == [1, 3]
    assert sample_requests(options, 0) != sample_requests(options, 1)  # no level finds another's prompts cached
    for index, level in enumerate(report["levels"]):
        requests = sample_requests(options, index)
        assert level["completed"] == 6 and level["failed"] == 0 and level["errors"] == []
        assert level["output_tokens"] == sum(n for _, n in requests)  # EOS ignored: exactly the sampled lengths
        assert level["prompt_tokens"] == sum(len(p) for p, _ in requests)
        assert level["output_tok_s"] > 0 and level["request_throughput"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = level[metric]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
        # the chart's points: a gap per streamed chunk after each request's first, in time order within the level
        times = [t for t, _ in level["itl_over_time"]]
        assert 0 < len(times) <= sum(n - 1 for _, n in requests) and times == sorted(times)
        assert 0 < times[0] and times[-1] <= level["duration_s"] and all(gap > 0 for _, gap in level["itl_over_time"])
    assert (tmp_path / "serve.png").read_bytes().startswith(b"\x89PNG")
    table = (tmp_path / "table.txt").read_text()
    assert "TTFT mean/p50/p90/p99 ms" in table and len(table.splitlines()) == 6


def test_bench_serve_counts_refused_requests_as_failed(served, capsys):
    from mini_infer.bench.cli import build_parser
    from mini_infer.bench.serve import run_bench_serve

    _, server = served
    argv = ["bench-serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "2",
            "--max-concurrency", "2", "--input-len", "8", "--output-len", "5000", "--range-ratio", "0"]
    levels = run_bench_serve(build_parser().parse_args(argv), log=lambda _: None)["levels"]
    assert levels[0]["completed"] == 0 and levels[0]["failed"] == 2
    assert "HTTP 400" in levels[0]["errors"][0] and "max_model_len (4096)" in levels[0]["errors"][0]
    assert "concurrency 2 error: HTTP 400" in capsys.readouterr().out


def test_bench_serve_without_a_server_says_so(capsys):
    from mini_infer.entrypoints.cli import main

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert main(["bench-serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2
    assert "cannot reach a server" in capsys.readouterr().err


def test_metrics_count_speculative_decoding(tiny_model_dir):
    # the model as its own draft (k every step: adaptive k would only probe with a draft as dear as the target)
    speculative = {"model": str(tiny_model_dir), "num_speculative_tokens": 3, "adaptive": False}
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS, speculative_config=speculative),
                            EngineMetrics(MODEL_NAME))
    with ServerThread(build_app(engine, MODEL_NAME)) as server:
        # (with the preset's generation_config defaults: Qwen2.5's repetition_penalty among them)
        body = {"prompt": "one two three", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        assert post(server, "/v1/completions", body).json()["usage"]["completion_tokens"] == 12
        samples = metric_samples(server)
        spec = engine.engine.stats().spec_decode
    engine.shutdown()

    def value(name, **labels):
        return samples[(name, frozenset(labels.items()))]

    assert value("mini_infer:spec_decode_num_drafts_total") == spec.num_drafts > 0
    assert value("mini_infer:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens > 0
    assert value("mini_infer:spec_decode_num_accepted_tokens_total") == spec.num_accepted_tokens > 0
    assert value("mini_infer:spec_decode_num_emitted_tokens_total") == spec.num_emitted_tokens
    for position, count in enumerate(spec.accepted_per_position):
        assert value("mini_infer:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == count
