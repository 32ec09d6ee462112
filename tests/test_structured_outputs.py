"""Structured outputs (xgrammar): constraints compiled and cached, the batch bitmask against a per-row reference,
every output of a mixed batch valid (random weights), parity of the unconstrained rows, preemption, n > 1, the
server's fields and their 400s."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch
import xgrammar as xgr

from mini_infer import LLM, SamplingParams, StructuredOutputsParams
from mini_infer.errors import InvalidRequestError
from mini_infer.runner.sampler import apply_bitmask
from tests.test_server import ENGINE_ARGS, post, start

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}}}
LIST = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 99}}


def _valid(value, schema) -> bool:
    """A small JSON-schema check for the schemas above (type, enum, bounds, required, no extra keys, items)."""
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if kind == "object":
        return (isinstance(value, dict) and set(value) == set(schema["required"])
                and all(_valid(value[k], schema["properties"][k]) for k in value))
    if kind == "array":
        return (isinstance(value, list) and schema["minItems"] <= len(value) <= schema["maxItems"]
                and all(_valid(v, schema["items"]) for v in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema["minimum"] <= value <= schema["maximum"])
    if kind == "string":
        return isinstance(value, str) and schema["minLength"] <= len(value) <= schema["maxLength"]
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(schema)


def _constraints():
    """(StructuredOutputsParams, checker of the output text) of every kind, bounded so that a random-weight model
    finishes them within max_tokens."""
    return [
        (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), lambda t: _valid(json.loads(t), PERSON)),
        (StructuredOutputsParams(json=json.dumps(POINT), disable_any_whitespace=True),
         lambda t: _valid(json.loads(t), POINT)),
        (StructuredOutputsParams(json=LIST, disable_any_whitespace=True), lambda t: _valid(json.loads(t), LIST)),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (StructuredOutputsParams(regex=r"(yes|no), because [a-z]{1,8}\."),
         lambda t: re.fullmatch(r"(yes|no), because [a-z]{1,8}\.", t)),
        (StructuredOutputsParams(choice=["red", "green", "blue \"navy\""]), lambda t: t in ("red", "green",
                                                                                             'blue "navy"')),
        (StructuredOutputsParams(grammar='root ::= "ok" | "no" [0-9] [0-9]'), lambda t: re.fullmatch(r"ok|no\d\d", t)),
    ]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), **ENGINE_ARGS)


def _reference_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask applied one row and one token at a time."""
    out = logits.clone()
    for row in rows:
        for token in range(vocab):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


def _native_mask_rows():
    from mini_infer.kernels import fused
    from mini_infer.kernels.build import KernelUnavailable
    from mini_infer.kernels.cpu import native_function

    try:
        native_function("mask_rows")
    except KernelUnavailable as e:
        pytest.skip(f"native kernels unavailable here: {e}")
    return fused.mask_rows


@pytest.mark.parametrize("how, dtype", [("torch", torch.float32), ("torch", torch.float64),
                                        ("native", torch.float32)])
def test_bitmask_matches_a_per_row_reference(how, dtype):
    vocab, num_rows = 203, 5  # a last word only partly in the vocabulary
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, (vocab + 31) // 32), dtype=torch.int32,
                            generator=generator)
    bitmask[2, 1] = -1  # a word allowing all 32 tokens, one allowing none
    bitmask[2, 3] = 0
    wide = torch.randn(num_rows, vocab + 13, dtype=dtype, generator=generator)
    logits = wide[:, :vocab]  # rows that are slices of wider ones, as the model's padded logits
    rows = [0, 2, 3]  # rows 1 and 4 unconstrained: untouched whatever their bitmask rows hold
    expected = _reference_mask(logits, rows, bitmask, vocab)
    apply = apply_bitmask if how == "torch" else _native_mask_rows()
    apply(logits, rows, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(expected[rows]).any() and not torch.isinf(expected[[1, 4]]).any()
    assert not torch.isinf(wide[:, vocab:]).any()  # nothing past the slice


def test_every_output_of_a_mixed_batch_is_valid_and_unconstrained_rows_keep_their_tokens(llm):
    constraints = _constraints()
    prompts = [f"Request {i}: tell me something." for i in range(2 * len(constraints) + 3)]
    params = []
    for i, _ in enumerate(prompts):
        if i < 2 * len(constraints):  # each constraint greedy and sampled (temperature 0.9, top_k 50)
            structured = constraints[i % len(constraints)][0]
            params.append(SamplingParams(temperature=0 if i < len(constraints) else 0.9, top_k=50, seed=i,
                                         max_tokens=48, structured_outputs=structured))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=12))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (output, p) in enumerate(zip(outputs, params)):
        completion = output.outputs[0]
        if p.structured_outputs is None:
            alone = llm.generate([prompts[i]], p, use_tqdm=False)[0].outputs[0]
            assert completion.token_ids == alone.token_ids
            continue
        assert completion.finish_reason == "stop", (i, completion.text)
        assert constraints[i % len(constraints)][1](completion.text), (i, completion.text)
    assert llm.engine.kv_cache_usage() == 0


def test_a_constraint_changes_what_the_model_says(llm):
    """Greedy, the random model's own first tokens are not a regex match: the mask is what makes them one."""
    free = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", free.text)
    constrained = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=(
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"))), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", constrained.text)


def test_grammars_are_compiled_once_per_constraint(llm):
    grammars = llm.engine.processor.grammars
    params = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma-7"]))
    before = grammars.num_compiled
    llm.generate(["a", "b", "c"], params, use_tqdm=False)
    llm.generate(["d"], params, use_tqdm=False)
    assert grammars.num_compiled == before + 1
    # A schema given as a dict or its text with the keys in another order is the same constraint.
    first = grammars.compile(StructuredOutputsParams(json={"type": "object", "required": ["a"],
                                                           "properties": {"a": {"type": "integer"}}}))
    again = grammars.compile(StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}},
                                                           "required": ["a"], "type": "object"}))
    assert first is again


def test_the_grammar_cache_is_bounded_by_bytes(llm, monkeypatch):
    from mini_infer.engine import structured_output

    grammars = llm.engine.processor.grammars
    monkeypatch.setattr(structured_output, "MAX_CACHE_BYTES", 1)  # room for the newest grammar only
    first, second = StructuredOutputsParams(regex="a+b"), StructuredOutputsParams(regex="b+a")
    grammars.compile(first)
    grammars.compile(second)
    before = grammars.num_compiled
    grammars.compile(second)  # the newest stays
    assert grammars.num_compiled == before
    grammars.compile(first)  # evicted: compiled again
    assert grammars.num_compiled == before + 1


def test_preemption_leaves_a_constrained_request_as_it_was(tiny_model_dir, llm):
    """A request preempted (recomputed) keeps its tokens and its matcher: the same greedy output as alone."""
    structured = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=structured)
    alone = llm.generate(["Who?"], params, use_tqdm=False)[0].outputs[0]
    tight = LLM(str(tiny_model_dir), dtype="float64", num_kv_blocks=16, block_size=4, max_num_seqs=8)
    prompts = ["Who?", *(f"filler prompt number {i} " * 2 for i in range(5))]
    all_params = [params, *[SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 5]
    outputs = tight.generate(prompts, all_params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert outputs[0].outputs[0].token_ids == alone.token_ids
    assert _valid(json.loads(outputs[0].outputs[0].text), PERSON)
    assert tight.engine.kv_cache_usage() == 0


def test_n_completions_each_follow_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=POINT, disable_any_whitespace=True))
    completions = llm.generate(["Point:"], params, use_tqdm=False)[0].outputs
    assert len(completions) == 3
    for completion in completions:
        assert _valid(json.loads(completion.text), POINT), completion.text


def test_ignore_eos_ends_when_the_grammar_is_complete(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["north", "south"]))
    completion = llm.generate(["Go"], params, use_tqdm=False)[0].outputs[0]
    assert completion.text in ("north", "south") and completion.finish_reason == "stop"


@pytest.mark.parametrize("structured, message", [
    (dict(json={"type": "objectx"}), "json constraint cannot be compiled"),
    (dict(regex="(ab"), "regex constraint cannot be compiled"),
    (dict(grammar="root ::= "), "grammar constraint cannot be compiled"),
])
def test_a_constraint_that_cannot_compile_is_refused(llm, structured, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(**structured)))
    assert error.value.field == "structured_outputs" and "/project/" not in str(error.value)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_usage() == 0


@pytest.mark.parametrize("kwargs", [dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice=["a", ""]),
                                    dict(json=3), dict(regex="a", disable_any_whitespace="yes")])
def test_malformed_structured_outputs_params(kwargs):
    with pytest.raises(InvalidRequestError) as error:
        StructuredOutputsParams(**kwargs)
    assert error.value.field == "structured_outputs"


# ---- the server ----

@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine, server = start(tiny_model_dir, api_key="sk-structured")
    with server:
        yield engine, server
    engine.shutdown()


def _server_post(server, path, body):
    return post(server, path, body, headers={"Authorization": "Bearer sk-structured"})


def test_thirty_two_concurrent_constrained_requests_through_the_server(served):
    """Schemas (response_format, structured_outputs, guided_json), regexes and choices, chat and completions,
    greedy and sampled, at once: every answer valid."""
    _, server = served
    constraints = _constraints()
    bodies, checks = [], []
    for i in range(32):
        structured, check = constraints[i % len(constraints)]
        body = {"max_tokens": 48, "temperature": 0 if i % 2 else 0.8, "seed": i}
        kind = structured.kind
        value = getattr(structured, kind)
        whitespace = {"disable_any_whitespace": True} if kind == "json" else {}
        if kind == "json":  # (any whitespace, the default, lets a random model ramble: tested below)
            body["structured_outputs"] = {"json": value, **whitespace}
        elif i % 3 == 0:
            body[f"guided_{kind}"] = value
        elif i % 3 == 1 and kind == "regex":  # an option with another field's constraint is not a second one
            body.update(guided_regex=value, structured_outputs={"disable_any_whitespace": False})
        else:
            body["structured_outputs"] = {kind: value}
        if i % 4 < 2:
            body["messages"] = [{"role": "user", "content": f"question {i}"}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = f"question {i}:"
            path = "/v1/completions"
        bodies.append((path, body))
        checks.append(check)

    async def run():
        import httpx

        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer sk-structured"},
                                     timeout=120) as client:
            return await asyncio.gather(*(client.post(path, json=body) for path, body in bodies))

    responses = asyncio.run(run())
    for i, (response, check) in enumerate(zip(responses, checks)):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and check(text), (i, bodies[i], text)


def test_response_format_json_schema_and_json_object_through_the_openai_client(served):
    import openai

    _, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-structured")
    answer = client.chat.completions.create(
        model="tiny-test", messages=[{"role": "user", "content": "a person"}], temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})  # vLLM's way to add the option
    text = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert _valid(json.loads(text), PERSON), text
    # json_object: with random weights the object may not close in max_tokens; what came is a JSON object's start.
    answer = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "json"}],
                                            temperature=0, max_tokens=24, response_format={"type": "json_object"})
    matcher = xgr.GrammarMatcher(served[0]._processor.grammars.compile(StructuredOutputsParams(json_object=True)))
    assert answer.choices[0].message.content.startswith("{")
    assert matcher.accept_string(answer.choices[0].message.content)


def test_streamed_constrained_output(served):
    _, server = served
    body = {"messages": [{"role": "user", "content": "stream"}], "max_tokens": 48, "temperature": 0, "stream": True,
            "structured_outputs": {"json": POINT, "disable_any_whitespace": True}}
    response = _server_post(server, "/v1/chat/completions", body)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert _valid(json.loads(text), POINT), text


@pytest.mark.parametrize("extra, field", [
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"disable_any_whitespace": 1}, "guided_regex": "a"}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_whitespace_pattern": " *", "guided_regex": "a"}, "guided_whitespace_pattern"),
])
def test_bad_constraints_are_a_400_naming_the_field(served, extra, field):
    engine, server = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
    response = _server_post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error
    # and the server goes on serving
    ok = _server_post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200


def test_tensor_parallel_gives_the_single_process_outputs(tiny_model_dir, llm):
    """The bitmask travels in the step plan to every rank (a data-parallel replica is an engine of its own, as
    here)."""
    constraints = [_constraints()[i] for i in (0, 3, 5)]  # a schema, a regex, a choice
    prompts = [f"parallel {i}" for i in range(len(constraints))] + ["free"]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c, _ in constraints]
    params.append(SamplingParams(temperature=0, max_tokens=8))
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    parallel = LLM(str(tiny_model_dir), dtype="float64", num_kv_blocks=512, tensor_parallel_size=2)
    try:
        outputs = parallel.generate(prompts, params, use_tqdm=False)
    finally:
        parallel.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output, (_, check) in zip(outputs, constraints):
        assert check(output.outputs[0].text)


# ---- JSON whitespace, bounded by default ----

def test_a_json_constraint_bounds_each_run_of_whitespace_and_keeps_control_characters_out_of_strings(llm):
    from mini_infer.config import DEFAULT_MAX_JSON_WHITESPACE
    from mini_infer.engine.structured_output import GrammarCompiler

    grammars = llm.engine.processor.grammars
    assert grammars.max_whitespace == DEFAULT_MAX_JSON_WHITESPACE == 20
    for structured in (StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json_object=True)):
        matcher = xgr.GrammarMatcher(grammars.compile(structured))
        assert matcher.accept_string("{" + " \n\t\r" * 5)  # 20 characters of whitespace
        assert not matcher.accept_string(" ")  # the 21st
        assert matcher.accept_string('"name"')  # the object goes on
    person = xgr.GrammarMatcher(grammars.compile(StructuredOutputsParams(json=PERSON)))
    assert person.accept_string('{"name":"a') and not person.accept_string("\t")  # JSON strings hold no raw tab
    assert person.accept_string('b"') and person.accept_string(',"age":7,"pet":"cat"}')
    unbounded = GrammarCompiler(llm.get_tokenizer(), grammars.vocab_size, llm.engine.processor.eos_token_ids,
                                max_whitespace=None)
    assert xgr.GrammarMatcher(unbounded.compile(StructuredOutputsParams(json=PERSON))).accept_string("{" + " " * 200)
    tight = xgr.GrammarMatcher(grammars.compile(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)))
    assert not tight.accept_string("{ ")  # disable_any_whitespace: none at all


def test_schema_answers_sampled_at_temperature_one_close_within_80_tokens(llm):
    """Any whitespace allowed (the default) and a random model sampled at temperature 1: every answer of a batch
    closes as valid JSON, where unbounded whitespace ran every one to max_tokens."""
    params = [SamplingParams(temperature=1.0, max_tokens=80, seed=seed,
                             structured_outputs=StructuredOutputsParams(json=PERSON)) for seed in range(8)]
    outputs = llm.generate([f"person {seed} as JSON:" for seed in range(8)], params, use_tqdm=False)
    for output in outputs:
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop" and _valid(json.loads(text), PERSON), text


def test_the_whitespace_bound_is_an_engine_option(tiny_model_dir):
    import argparse

    from mini_infer.config import EngineConfig
    from mini_infer.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).structured_outputs_max_whitespace == 20
    for flag, value in (("off", None), ("4", 4)):
        args = parser.parse_args(["--structured-outputs-max-whitespace", flag])
        assert EngineArgs.from_cli_args(args).structured_outputs_max_whitespace == value
    with pytest.raises(ValueError, match="structured_outputs_max_whitespace"):
        EngineConfig(model=str(tiny_model_dir), structured_outputs_max_whitespace=0)
