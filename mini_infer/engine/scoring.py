"""Scoring pairs of texts (vLLM's LLM.score and /v1/score, /v1/rerank): which pairs a request's two sides make, a
reranker's prompt for a pair, and an embedding model's score of a pair.

A reranker (task score) reads one prompt per pair: the first text's tokens then the second's, as the tokenizer's
pair encoding joins them (Qwen's adds nothing between; a caller formats Qwen3-Reranker's instruction template into
the texts, as vLLM's example does). An embedding model (task embed) scores a pair by the cosine similarity of the two
texts' embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_infer.engine.input_processor import check_text
from mini_infer.errors import InvalidRequestError

PairSide = str | list[str] | list[int] | list[list[int]]  # one text or token-id list, or a list of them


def score_pairs(first: PairSide, second: PairSide, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple]:
    """The (first, second) pairs to score, as vLLM forms them: one first item against each second item (1:1 or 1:N),
    or equally long lists paired in order (N:N); InvalidRequestError naming the side at fault."""
    firsts, seconds = _items(first, names[0]), _items(second, names[1])
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidRequestError(f"{names[0]} has {len(firsts)} items and {names[1]} {len(seconds)}: give one "
                                  f"{names[0]} item or as many as {names[1]} has", names[0])
    return list(zip(firsts, seconds))


def _items(side: PairSide, name: str) -> list:
    if isinstance(side, str) or (isinstance(side, list) and side and all(isinstance(t, int) for t in side)):
        side = [side]
    if not isinstance(side, list) or not side:
        raise InvalidRequestError(f"{name} must be a text, token ids or a non-empty list of them", name)
    for item in side:
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{name} has an empty text", name)
            check_text(item, name)
        elif not (isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in item)):
            raise InvalidRequestError(f"{name} items must be non-empty texts or token-id lists, got {item!r:.80}",
                                      name)
    return side


def pair_prompt(tokenizer, first: str | list[int], second: str | list[int]) -> dict:
    """A reranker's prompt for one pair ({"prompt_token_ids": ...}, with the joined text when both are texts): two
    texts as the tokenizer's pair encoding gives them, token ids joined as they are."""
    if isinstance(first, str) and isinstance(second, str):
        if tokenizer is None:
            raise InvalidRequestError("text pairs need a tokenizer and this model directory has no tokenizer.json; "
                                      "pass token ids instead", "text_1")
        return {"prompt": first + second, "prompt_token_ids": tokenizer(first, second)["input_ids"]}
    if isinstance(first, str) or isinstance(second, str):
        raise InvalidRequestError("a pair is two texts or two token-id lists, not one of each", "text_2")
    return {"prompt_token_ids": first + second}


def distinct(items: list) -> tuple[list, list[int]]:
    """The distinct items (texts or token-id lists), in first-seen order, and each item's place among them: an
    embedding model embeds a query scored against many documents once."""
    places: dict = {}
    unique, index = [], []
    for item in items:
        key = item if isinstance(item, str) else tuple(item)
        if key not in places:
            places[key] = len(unique)
            unique.append(item)
        index.append(places[key])
    return unique, index


def cosine_similarities(firsts: list[list[float]], seconds: list[list[float]]) -> list[float]:
    """Of each pair of embeddings (an embedding model's score of a pair), in one batched op."""
    return F.cosine_similarity(torch.tensor(firsts, dtype=torch.float64), torch.tensor(seconds, dtype=torch.float64),
                               dim=-1).tolist()
