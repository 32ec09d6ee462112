"""Sampling knobs end to end through LLM.generate, against HF transformers (the engine on
MINI_INFER_TEST_DEVICE, HF on the CPU): seeds, logprobs, stop tokens, min/max tokens, penalties, stop strings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DEVICE, build_hf_model, save_hf_model
from test_sampler import expected_penalised

from mini_infer import LLM, SamplingParams

PROMPTS = [[11, 12, 13, 14, 15], [400, 3], [7] * 9, [999, 0, 500, 250]]


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model(seed=3, vocab_size=1000)


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory):
    return save_hf_model(hf_model, tmp_path_factory.mktemp("sampler-model"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float64", device=DEVICE, block_size=4, max_model_len=128, seed=0)


def hf_reference(model, prompt, max_tokens, *, min_tokens=0, stop_ids=()) -> tuple[list[int], str]:
    """Greedy decoding by full HF forwards, with min_tokens masking and stop ids, as vLLM defines them."""
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_tokens:
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            if len(tokens) < min_tokens:
                logits[list(stop_ids)] = float("-inf")
            tokens.append(int(logits.argmax()))
            if tokens[-1] in stop_ids:
                return tokens, "stop"
    return tokens, "length"


@pytest.fixture(scope="module")
def greedy_reference(hf_model) -> list[int]:
    """HF's greedy continuation of PROMPTS[0] (20 tokens)."""
    return hf_reference(hf_model, PROMPTS[0], 20)[0]


def hf_log_softmax(model, prompt, tokens) -> torch.Tensor:
    """log_softmax of HF's logits at every position that predicted one of `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits, dim=-1)


def generate_one(llm, prompt, params):
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0]


def test_seeded_generate_is_independent_of_the_batch(llm):
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = generate_one(llm, PROMPTS[0], target).token_ids
    others = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=10, seed=99, max_tokens=3, ignore_eos=True)]
    batched = llm.generate(PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:], others[:2] + [target] + others[2:],
                           use_tqdm=False)
    assert batched[2].outputs[0].token_ids == alone
    first = llm.generate([PROMPTS[0]] * 2 + PROMPTS[1:], [target, target] + others, use_tqdm=False)
    assert first[0].outputs[0].token_ids == alone and first[1].outputs[0].token_ids == alone
    other_seed = generate_one(llm, PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.95, seed=1235,
                                                               max_tokens=12, ignore_eos=True))
    assert other_seed.token_ids != alone


def test_seeded_generate_survives_preemption(model_dir):
    # 6 blocks of 4 tokens cannot hold four growing requests: some are preempted and recomputed.
    tight = LLM(str(model_dir), dtype="float64", device=DEVICE, block_size=4, num_kv_blocks=6, max_model_len=20,
                seed=5)
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=10, ignore_eos=True)
    alone = generate_one(tight, PROMPTS[3], params).token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    outputs = tight.generate(PROMPTS, [others, others, others, params], use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert outputs[3].outputs[0].token_ids == alone


def test_greedy_logprobs_match_hf(llm, hf_model):
    prompt = PROMPTS[0]
    out = generate_one(llm, prompt, SamplingParams(temperature=0.0, logprobs=5, max_tokens=8, ignore_eos=True))
    assert out.token_ids == hf_reference(hf_model, prompt, 8)[0]
    reference = hf_log_softmax(hf_model, prompt, out.token_ids)
    assert len(out.logprobs) == 8
    for token, entry, expected in zip(out.token_ids, out.logprobs, reference):
        top = expected.topk(5)
        assert set(entry) == {token} | set(top.indices.tolist()) and len(entry) == 5
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-6)
        assert entry[token].rank == 1 and entry[token].decoded_token is None
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[tid].rank == rank and entry[tid].logprob == pytest.approx(value, abs=1e-6)
    total = sum(expected[t].item() for t, expected in zip(out.token_ids, reference))
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_sampled_logprobs_include_the_sampled_token(llm, hf_model):
    prompt = PROMPTS[1]
    out = generate_one(llm, prompt, SamplingParams(temperature=5.0, seed=3, logprobs=3, max_tokens=10,
                                                   ignore_eos=True))
    reference = hf_log_softmax(hf_model, prompt, out.token_ids)
    outside_top = 0
    for token, entry, expected in zip(out.token_ids, out.logprobs, reference):
        top_ids = expected.topk(3).indices.tolist()
        assert set(entry) == {token} | set(top_ids)
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-6)
        assert entry[token].rank == 1 + int((expected > expected[token]).sum())
        outside_top += token not in top_ids
    assert outside_top > 0  # at T=5 some samples fall outside the top 3, and are still reported


def test_logprobs_zero_reports_only_the_sampled_token(llm, hf_model):
    out = generate_one(llm, PROMPTS[2], SamplingParams(temperature=0.0, logprobs=0, max_tokens=4, ignore_eos=True))
    reference = hf_log_softmax(hf_model, PROMPTS[2], out.token_ids)
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]
    for token, entry, expected in zip(out.token_ids, out.logprobs, reference):
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-6)
    plain = generate_one(llm, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert plain.logprobs is None and plain.cumulative_logprob is None


def _first_fresh_token(tokens: list[int], start: int) -> int:
    """An index >= start whose token does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_stop_with_the_token_included(llm, greedy_reference):
    prompt, greedy = PROMPTS[0], greedy_reference
    k = _first_fresh_token(greedy, 5)
    out = generate_one(llm, prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[3, greedy[k]]))
    assert out.token_ids == greedy[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", greedy[k])


def test_min_tokens_prevents_an_early_stop_token(llm, hf_model, greedy_reference):
    prompt, greedy = PROMPTS[0], greedy_reference
    k = _first_fresh_token(greedy, 2)
    stop = greedy[k]
    min_tokens = k + 3
    expected, reason = hf_reference(hf_model, prompt, 20, min_tokens=min_tokens, stop_ids=[stop])
    out = generate_one(llm, prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=min_tokens,
                                                   stop_token_ids=[stop]))
    assert out.token_ids == expected
    assert out.token_ids[:k] == greedy[:k] and out.token_ids[k] != stop
    assert stop not in out.token_ids[:min_tokens]
    assert out.finish_reason == reason
    assert out.stop_reason == (stop if reason == "stop" else None)


@pytest.fixture(scope="module")
def eos_setup(hf_model, model_dir, tmp_path_factory):
    """A copy of the model whose config.json names a token it emits greedily as EOS."""
    greedy, _ = hf_reference(hf_model, PROMPTS[1], 16)
    k = _first_fresh_token(greedy, 4)
    path = tmp_path_factory.mktemp("eos-model")
    for item in model_dir.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = greedy[k]
    (path / "config.json").write_text(json.dumps(config))
    return LLM(str(path), dtype="float64", device=DEVICE, block_size=4, max_model_len=64), greedy, k


def test_eos_stops_unless_ignored_or_under_min_tokens(eos_setup, hf_model):
    eos_llm, greedy, k = eos_setup
    eos = greedy[k]
    out = generate_one(eos_llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16))
    assert out.token_ids == greedy[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = generate_one(eos_llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert out.token_ids == greedy and out.finish_reason == "length"
    expected, reason = hf_reference(hf_model, PROMPTS[1], 16, min_tokens=k + 2, stop_ids=[eos])
    out = generate_one(eos_llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=k + 2))
    assert out.token_ids == expected and eos not in out.token_ids[: k + 2]
    assert out.finish_reason == reason


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_max_tokens_finishes_with_length(llm, hf_model, max_tokens):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        out = output.outputs[0]
        assert out.token_ids == hf_reference(hf_model, prompt, max_tokens)[0]
        assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_penalties_end_to_end_match_hf(llm, hf_model):
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.3)
    out = generate_one(llm, prompt, params)
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(8):
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, -1].tolist()
            penalised = expected_penalised(logits, prompt, tokens, 1.3, 0.4, 0.3)
            tokens.append(int(penalised.argmax()))
    assert out.token_ids == tokens
    assert tokens != hf_reference(hf_model, prompt, 8)[0]  # the penalties changed the output


# ---- stop strings (real tokenizer) ----

# The random tiny model repeats itself when greedy, so the text comes from seeded sampling instead:
# a seeded request alone is reproducible, which is all that cutting at a known place needs.
TEXT_PROMPT = "Once upon a time"


def text_params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def text_llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device=DEVICE, max_model_len=256, block_size=8)
    return llm, generate_one(llm, TEXT_PROMPT, text_params())


def _plain_piece(text: str, start: int, length: int) -> str:
    """The first substring of `length` at or after `start` with no replacement character and no
    whitespace at its edges."""
    for i in range(start, len(text) - length + 1):
        piece = text[i: i + length]
        if "\ufffd" not in piece and piece == piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def _assert_cut_at_first_completion(llm, out, greedy, stop):
    """The request stopped on the token that completed the stop string's first occurrence."""
    tokenizer = llm.get_tokenizer()
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]
    assert stop in tokenizer.decode(out.token_ids)
    assert stop not in tokenizer.decode(out.token_ids[:-1])


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("where", [0.3, 0.6])
def test_stop_string_cuts_the_text(text_llm, include, where):
    llm, full = text_llm
    text = full.text
    assert len(text) >= 30 and len(set(text)) > 15, text  # varied text, not a repetition
    stop = _plain_piece(text, int(len(text) * where), 3)
    index = text.find(stop)
    out = generate_one(llm, TEXT_PROMPT, text_params(stop=stop, include_stop_str_in_output=include))
    assert out.text == text[: index + (len(stop) if include else 0)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    _assert_cut_at_first_completion(llm, out, full, stop)
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_string_spanning_two_tokens(text_llm):
    llm, full = text_llm
    tokenizer = llm.get_tokenizer()
    # A token boundary in the middle of the text with plain characters on both sides.
    for j in range(len(full.token_ids) // 2, len(full.token_ids) - 1):
        boundary = len(tokenizer.decode(full.token_ids[:j]))
        stop = full.text[boundary - 2: boundary + 2]
        if full.text.startswith(tokenizer.decode(full.token_ids[:j])) and "\ufffd" not in stop \
                and stop == stop.strip() and len(stop) == 4 and full.text.find(stop) == boundary - 2:
            break
    else:
        pytest.fail(f"no token boundary to straddle in {full.text!r}")
    out = generate_one(llm, TEXT_PROMPT, text_params(stop=stop))
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[: boundary - 2], "stop", stop)
    _assert_cut_at_first_completion(llm, out, full, stop)
    assert len(out.token_ids) > j  # the stop string was completed by a later token than where it starts


def test_stop_strings_completed_by_the_same_token_cut_at_the_earliest(text_llm):
    llm, full = text_llm
    tokenizer = llm.get_tokenizer()
    for j in range(len(full.token_ids) // 3, len(full.token_ids)):
        start = len(tokenizer.decode(full.token_ids[:j]))
        piece = tokenizer.decode(full.token_ids[j: j + 1])
        first, last = piece.strip()[:2], piece.strip()[-2:]
        if (len(piece.strip()) >= 4 and "\ufffd" not in piece and full.text.find(first) >= start
                and full.text.find(last) > full.text.find(first) + 1):
            break
    else:
        pytest.fail(f"no suitable token in {full.text!r}")
    out = generate_one(llm, TEXT_PROMPT, text_params(stop=[last, first]))
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[: full.text.find(first)], "stop", first)
    assert out.token_ids == full.token_ids[: j + 1]


def test_earliest_of_several_stop_strings_wins(text_llm):
    llm, full = text_llm
    text = full.text
    early = _plain_piece(text, len(text) // 4, 2)
    late = _plain_piece(text, len(text) * 2 // 3, 3)
    assert text.find(late) > text.find(early) + len(early)
    out = generate_one(llm, TEXT_PROMPT, text_params(stop=[late, "\u2603never\u2603", early]))
    assert (out.text, out.finish_reason, out.stop_reason) == (text[: text.find(early)], "stop", early)


def test_stop_string_absent_runs_to_length(text_llm):
    llm, full = text_llm
    out = generate_one(llm, TEXT_PROMPT, text_params(stop="\u2603never\u2603"))
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
        full.text, full.token_ids, "length", None)


def test_stop_string_waits_for_min_tokens(text_llm):
    llm, full = text_llm
    tokenizer = llm.get_tokenizer()

    def setting(stop: str) -> tuple[int, int]:
        """(min_tokens just past the stop's first occurrence, where it may first stop the request)."""
        first = next(j for j in range(1, len(full.token_ids) + 1) if stop in tokenizer.decode(full.token_ids[:j]))
        # Only text from the min_tokens-th token on may stop the request (one-character stop: no straddling).
        allowed_from = len(tokenizer.decode(full.token_ids[: first + 1]))
        return first + 2, full.text.find(stop, allowed_from)

    # The first one-character stop string that occurs again after min_tokens allows stopping.
    stop = next(piece for i in range(len(full.text)) if (piece := _plain_piece(full.text, i, 1)) and
                setting(piece)[1] > 0)
    min_tokens, index = setting(stop)
    assert index > full.text.find(stop) >= 0
    out = generate_one(llm, TEXT_PROMPT, text_params(stop=stop, min_tokens=min_tokens))
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:index], "stop", stop)
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert stop not in tokenizer.decode(out.token_ids[min_tokens - 1: -1])
    assert stop in tokenizer.decode(out.token_ids[-1:])
