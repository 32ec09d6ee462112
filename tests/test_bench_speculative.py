"""`mini-infer bench --speculative`: the draft half end to end on tiny models (its files, and the steering proposer
doing what it says: at alpha 1 every draft accepted, at alpha 0 none, outputs equal to speculation off), the
copy-with-edits requests of the n-gram half, and the flags. Correctness only: no timing is asserted."""

from __future__ import annotations

import argparse
import json

import pytest

from mini_infer.bench.options import BenchOptions, add_bench_args
from mini_infer.bench.speculative import copy_requests, expected_tokens
from mini_infer.engine.detokenizer import load_tokenizer
from mini_infer.entrypoints.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    """A tiny model of other random weights than the target's: its own drafts are (almost) never the target's."""
    from mini_infer.factory import make_model

    return make_model("tiny", tmp_path_factory.mktemp("draft") / "model", seed=1, dtype="float32")


def test_draft_bench_steers_acceptance_and_writes_its_files(tiny_model_dir, tiny_draft_dir, tmp_path, capsys):
    out = tmp_path / "spec"
    assert main(["bench", "--speculative", "draft", "--model", str(tiny_model_dir), "--draft", str(tiny_draft_dir),
                 "--dtype", "float32", "--batches", "1", "--ks", "2", "--alphas", "1", "--adaptive-alphas", "none",
                 "--max-tokens", "8", "--warmup-tokens", "3", "--prompt-len", "16", "--reps", "1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "speculative-draft.json").read_text())
    assert (out / "speculative-draft.txt").read_text() in printed
    assert (out / "speculative-draft.png").read_bytes().startswith(PNG_MAGIC)
    rows = {row["alpha"]: row for row in report["rows"]}
    assert set(rows) == {0.0, 1.0}  # alpha 0 runs always: the cost model's costs come from it
    assert len(report["off_brackets"]) == 2  # before and after the one setting
    for alpha, row in rows.items():
        assert row["same_tokens"] == "1/1" and row["diverged"] == 0  # greedy: speculation changes no token
        assert row["num_draft_tokens"] > 0 and row["steered"] > 0
        assert row["c_verify"] > 0 and row["c_draft"] > 0 and row["predicted_speedup"] > 0
    # alpha 1: every draft is the target's own token, so every one is accepted
    assert rows[1.0]["num_accepted_tokens"] == rows[1.0]["num_draft_tokens"]
    assert rows[1.0]["acceptance"] == rows[1.0]["expected_acceptance"] == 1.0
    # alpha 0: every draft is wrong (a right one of the draft's own is changed, and counted), so none is accepted
    assert rows[0.0]["num_accepted_tokens"] == 0 and rows[0.0]["tokens_per_verify"] == 1.0
    assert 0 <= rows[0.0]["right_by_itself"] <= rows[0.0]["steered"]
    assert report["config"]["off_consistent"]


def test_expected_tokens_per_verify_step():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_copy_requests_ask_for_the_passage_with_edits(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts, params, wanted = copy_requests(tokenizer, 2, edit_every=4)
    assert len(prompts) == len(params) == len(wanted) == 2 and prompts[0] != prompts[1]
    for prompt, sampling, tokens in zip(prompts, params, wanted):
        edited = sampling.structured_outputs.choice[0]
        assert tokenizer.decode(tokens) == edited and sampling.max_tokens == len(tokens) + 1
        assert set(sampling.logit_bias) == set(tokens)
        words = edited.split(" ")
        assert sum(w != v for w, v in zip(words, tokenizer.decode(prompt).split("\n\n")[1].split(" "))) == \
            len(words) // 4  # every 4th word changed, the rest copied
        # the longer of two passage tokens gets the larger bias (its split wins where the grammar allows both)
        lengths = {t: len(tokenizer.decode([t])) for t in tokens}
        longest, shortest = max(lengths, key=lengths.get), min(lengths, key=lengths.get)
        assert lengths[longest] == lengths[shortest] or sampling.logit_bias[longest] > sampling.logit_bias[shortest]


def _options(*flags: str) -> BenchOptions:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return BenchOptions.from_args(parser.parse_args(list(flags)))


def test_speculative_flags():
    options = _options("--speculative", "ngram", "--ks", "4,2,4", "--prompt-lookup", "1,3")
    assert options.workload == "speculative-ngram" and options.ks == (2, 4) and options.prompt_lookup == (1, 3)
    options = _options("--speculative", "draft", "--alphas", "1,0.5", "--adaptive-alphas", "none")
    assert options.alphas == (0.5, 1.0) and options.adaptive_alphas == ()
    for flags, message in ((("--alphas", "1.5"), "--alphas"), (("--ks", "0"), "--ks"),
                           (("--quantization", "int8,int4"), "--quantization")):
        with pytest.raises(ValueError, match=message):
            _options("--speculative", "draft", *flags)
