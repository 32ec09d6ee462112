"""Stop conditions, decided in one place: EOS and stop token ids (once min_tokens outputs exist), max_tokens,
and stop strings in the detokenized text (which is cut there)."""

from __future__ import annotations

from mini_infer.engine.detokenizer import IncrementalDetokenizer
from mini_infer.engine.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, grammar_complete: bool = False) -> None:
    """After `token_id` was appended: update the request's text and set its status and stop reason if it is done
    (grammar_complete: its structured-output grammar ended it where the stop tokens do not: LLMEngine._advance_grammar).
    (The sampler masks the stop token ids while fewer than min_tokens outputs exist: Request.stop_token_ids.)"""
    may_stop = request.num_output_tokens >= request.params.min_tokens
    status, reason = None, None
    if may_stop and token_id in request.eos_token_ids:
        status = RequestStatus.FINISHED_STOPPED
    elif may_stop and token_id in request.params.stop_token_ids:
        status, reason = RequestStatus.FINISHED_STOPPED, token_id
    elif grammar_complete:
        status = RequestStatus.FINISHED_STOPPED
    elif request.num_output_tokens >= request.max_tokens:
        status = RequestStatus.FINISHED_LENGTH
    if request.detokenizer is not None:
        num_new_chars = request.detokenizer.update(request.output_token_ids, flush=status is not None)
        stop_string = find_stop_string(request.detokenizer, num_new_chars) if may_stop else None
        if stop_string is not None:
            status, reason = RequestStatus.FINISHED_STOPPED, stop_string
    if status is not None:
        request.status, request.stop_reason = status, reason


def find_stop_string(detokenizer: IncrementalDetokenizer, num_new_chars: int) -> str | None:
    """The first stop string that the newest characters complete; the text is cut there (after it, with
    include_stop_str_in_output)."""
    stops, text = detokenizer.stop_strings, detokenizer.output_text
    if not stops or not num_new_chars:
        return None
    # Each string may begin at most len(s) - 1 characters before the new ones: a short one finishing earlier
    # (before min_tokens allowed stopping, say) is not this step's.
    new_from = len(text) - num_new_chars
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    if not hits:
        return None
    index, stop = min(hits)
    detokenizer.output_text = text[: index + (len(stop) if detokenizer.include_stop else 0)]
    return stop
