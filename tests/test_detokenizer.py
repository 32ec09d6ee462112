"""Incremental detokenization with the real Qwen2.5 tokenizer: split UTF-8 characters, stop strings."""

from __future__ import annotations

import pytest

from mini_infer import SamplingParams
from mini_infer.engine.detokenizer import IncrementalDetokenizer, load_tokenizer, raw_decoder
from mini_infer.engine.stop import find_stop_string

TEXT = "Paged attention 🦙🚀 naïve café — 鬱鬱蔥蔥 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def stream(tokenizer, token_ids, params=None):
    detok = IncrementalDetokenizer(tokenizer, params or SamplingParams())
    pieces = []
    for n in range(1, len(token_ids) + 1):
        before = len(detok.output_text)
        detok.update(token_ids[:n], flush=n == len(token_ids))
        pieces.append(detok.output_text[before:])
    return detok, pieces


def test_multibyte_characters_split_across_tokens_are_never_emitted_half(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The test only means something if some token boundary falls inside a character.
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    detok, pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == detok.output_text == TEXT


def test_an_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("𓀀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    assert detok.update(ids[:1]) == 0  # held back: half a character
    assert detok.update(ids[:1], flush=True) > 0
    assert detok.output_text == "\ufffd"


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 151645
    assert stream(tokenizer, ids)[0].output_text == "hi"
    kept = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))[0]
    assert kept.output_text == "hi<|im_end|>"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(tokenizer, include):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["zzz", "thr"], include_stop_str_in_output=include))
    found = None
    for n in range(1, len(ids) + 1):
        found = find_stop_string(detok, detok.update(ids[:n]))
        if found:
            break
    assert found == "thr"
    assert detok.output_text == ("one two thr" if include else "one two ")


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop="four five"))
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok.update(ids)
    assert detok.output_text == "one two three"
    assert detok.visible_text(finished=False) == "one two three"[: -len("four five") + 1]
    assert detok.visible_text(finished=True) == "one two three"


def test_raw_decoder_gives_the_tokenizers_text(tokenizer):
    """The Rust tokenizer's decode, called without transformers' wrapper, gives the wrapper's text to the character,
    special tokens skipped or kept, across split UTF-8 characters; a tokenizer that cleans up spaces keeps the
    wrapper."""
    ids = tokenizer.encode(TEXT + " <|im_end|> (x) , ok !", add_special_tokens=False)
    decode = raw_decoder(tokenizer)
    assert decode is not None and not tokenizer.clean_up_tokenization_spaces
    for skip in (True, False):
        for end in range(len(ids) + 1):
            for start in (0, end // 2):
                assert decode(ids[start:end], skip) == tokenizer.decode(ids[start:end], skip_special_tokens=skip)
    calls = []

    class Cleaning:
        clean_up_tokenization_spaces = True
        backend_tokenizer = object()

        def decode(self, ids, skip_special_tokens):
            calls.append(ids)
            return "wrapped"
    assert raw_decoder(Cleaning())([1, 2], True) == "wrapped" and calls == [[1, 2]]


def test_tokenizer_files_are_parsed_once_until_they_change(tiny_model_dir, tmp_path):
    """Engines over models of one tokenizer share it, whatever their directories; an edited tokenizer file (here the
    chat template) is read again."""
    import json
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    first = load_tokenizer(copy)
    assert load_tokenizer(copy) is first and load_tokenizer(tiny_model_dir) is first
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}!"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    edited = load_tokenizer(copy)
    assert edited is not first and edited.chat_template == "{{ messages[0]['content'] }}!"
    assert edited.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
    assert load_tokenizer(tiny_model_dir) is first and first.chat_template != edited.chat_template
