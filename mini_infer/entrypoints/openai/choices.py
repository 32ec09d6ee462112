"""How the two endpoints spell their answers: a choice (whole, or a streamed delta), logprobs, usage."""

from __future__ import annotations

from mini_infer.entrypoints.openai.reasoning import ReasoningStream
from mini_infer.entrypoints.openai.tools import ToolChoice, ToolStream, merge
from mini_infer.outputs import Logprob


class Choices:
    """How one endpoint spells a choice, whole or as a streamed delta."""

    id_prefix: str
    object: str
    chunk_object: str

    def opening(self, index: int) -> dict | None:
        """A choice to stream before any text, or None."""
        return None

    def note_prompt(self, prompt_token_ids: list[int], prompt_logprobs: list | None) -> None:
        """An output's prompt token ids and prompt logprobs (the completions endpoint's echo uses them)."""

    def choice(self, index: int, text: str, logprobs: list[dict] | None, finish_reason: str | None, stop_reason,
               streaming: bool) -> dict | None:
        """The choice (streaming: its delta, or None when this text gives nothing out yet)."""
        raise NotImplementedError


class CompletionChoices(Choices):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, echo: str | None = None, decode=None) -> None:
        """echo: the prompt text, which each choice's first text then begins with (and, with logprobs, its
        logprobs with the prompt's: `decode` spells the first prompt token, which has none)."""
        self.text_offsets: dict[int, int] = {}  # each choice's offset of its next token, across a stream's chunks
        self.echo, self.decode = echo, decode
        self.echoed: set[int] = set()
        self.prompt_entries: list[dict] | None = None

    def note_prompt(self, prompt_token_ids, prompt_logprobs):
        if self.echo is not None and self.prompt_entries is None and prompt_logprobs is not None:
            first = prompt_token_ids[0]
            self.prompt_entries = [{first: Logprob(None, None, self.decode([first]))}, *prompt_logprobs[1:]]

    def choice(self, index, text, logprobs, finish_reason, stop_reason, streaming):
        if self.echo is not None and index not in self.echoed:
            self.echoed.add(index)
            text = self.echo + text
            if logprobs is not None and self.prompt_entries is not None:
                logprobs = self.prompt_entries + logprobs
        shaped = None
        if logprobs:
            shaped = _completion_logprobs(logprobs, self.text_offsets.get(index, 0))
            self.text_offsets[index] = self.text_offsets.get(index, 0) + sum(len(t) for t in shaped["tokens"])
        return {"index": index, "text": text, "logprobs": shaped, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


class ChatChoices(Choices):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, top_logprobs: int, tool_choice: ToolChoice | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str = "hermes") -> None:
        """tool_choice: how to read tool calls out of the text (None: the text is the content); reasoning_parser:
        how to split the reasoning off first (reasoning.py; None: there is none); tool_call_parser: the format of
        the calls tool_choice auto reads (tools.py)."""
        self.top_logprobs = top_logprobs
        self.tool_choice = tool_choice
        self.tool_call_parser = tool_call_parser
        self.tool_streams: dict[int, ToolStream] = {}  # a streamed choice's parser, by index
        self.reasoning_parser = reasoning_parser
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def opening(self, index):
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def choice(self, index, text, logprobs, finish_reason, stop_reason, streaming):
        shaped = _chat_logprobs(logprobs, self.top_logprobs) if logprobs else None
        reasoning = None
        if self.reasoning_parser is not None:  # the reasoning apart; the rest is read as the answer
            split = self.reasoning_streams.setdefault(index, ReasoningStream(self.reasoning_parser)) if streaming \
                else ReasoningStream(self.reasoning_parser)
            reasoning, text = split.feed(text, final=finish_reason is not None or not streaming)
        if self.tool_choice is None:
            if streaming:
                delta = {"reasoning_content": reasoning} if reasoning else {}
                if text or (finish_reason is None and not reasoning):
                    delta["content"] = text
                body = {"delta": delta}
            else:
                body = {"message": {"role": "assistant", **self._reasoning_field(reasoning),
                                    "content": text or None if self.reasoning_parser else text}}
            return {"index": index, **body, "logprobs": shaped, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        stream = ToolStream(self.tool_choice, self.tool_call_parser)
        if streaming:
            stream = self.tool_streams.setdefault(index, stream)
        deltas = stream.feed(text, final=finish_reason is not None or not streaming)
        if finish_reason is not None:
            finish_reason = stream.finish_reason or finish_reason
        if not streaming:
            content, calls = merge(deltas)
            return {"index": index, "message": {"role": "assistant", **self._reasoning_field(reasoning),
                                                "content": content, "tool_calls": calls},
                    "logprobs": shaped, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if not (deltas or reasoning or shaped or finish_reason):
            return None
        delta = {"reasoning_content": reasoning} if reasoning else {}
        for piece in deltas:  # one chunk's deltas as one: its content joined, its tool-call pieces in order
            if "content" in piece:
                delta["content"] = delta.get("content", "") + piece["content"]
            delta.setdefault("tool_calls", []).extend(piece.get("tool_calls", ()))
        if not delta.get("tool_calls"):
            delta.pop("tool_calls", None)
        return {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _reasoning_field(self, reasoning: str | None) -> dict:
        """A whole message's reasoning_content (with a reasoning parser; null when the output had none)."""
        return {"reasoning_content": reasoning or None} if self.reasoning_parser else {}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage: with the prompt tokens the prefix cache held (prompt_tokens_details.cached_tokens)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _completion_logprobs(logprobs: list[dict], text_offset: int) -> dict:
    """OpenAI's completions shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in logprobs:
        sampled = next(iter(entry.values()))  # the sampled token comes first
        token = sampled.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(sampled.logprob)  # None for an echoed prompt's first token, as OpenAI's
        top.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()} if sampled.logprob is not None
                   else None)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(logprobs: list[dict], top_n: int) -> dict:
    """OpenAI's chat shape: content = [{token, logprob, bytes, top_logprobs: [the top_n {token, logprob,
    bytes}]}]; each entry holds the sampled token first, then the most likely ones."""
    content = []
    for entry in logprobs:
        sampled = next(iter(entry.values()))
        top = [_chat_token(lp) for lp in sorted(entry.values(), key=lambda lp: lp.rank) if lp.rank <= top_n]
        content.append({**_chat_token(sampled), "top_logprobs": top})
    return {"content": content}


def _chat_token(lp) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}
