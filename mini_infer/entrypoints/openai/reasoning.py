"""Reasoning parsers (`serve --reasoning-parser`): the text a reasoning model thinks inside <think></think> comes back
apart from its answer, as vLLM returns it (`reasoning_content` in chat completions, a reasoning item in the Responses
API).

- qwen3: Qwen3 opens its thinking itself. An output that begins with <think> is reasoning up to </think> and content
  after it; an output that does not begin so (thinking off: the prompt ended in an empty think block) is all content.
- deepseek_r1: DeepSeek-R1's template opens the thinking in the prompt. The output is reasoning (a leading <think>
  dropped) up to </think>, content after it.

The split is exact: the reasoning is the text between the tags, the content the text after </think>, nothing
stripped. An output cut before </think> is all reasoning. Streamed or whole, the pieces join to the same split.
"""

from __future__ import annotations

from dataclasses import dataclass

from mini_infer.entrypoints.openai.tools import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return name


@dataclass(slots=True)
class ReasoningStream:
    """One output's split, fed its text as it comes: (reasoning, content) pieces out. A tag cut across two pieces
    of text is held back until it is whole (or the output ends)."""

    parser: str
    state: str = "start"  # start: the opening not yet known; reasoning; content
    pending: str = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.pending += text
        reasoning = ""
        if self.state == "start":
            if THINK_START.startswith(self.pending) and self.pending != THINK_START and not final:
                return "", ""  # may still become <think>
            opened = self.pending.startswith(THINK_START)
            if opened:
                self.pending = self.pending[len(THINK_START):]
            self.state = "reasoning" if opened or self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            end = self.pending.find(THINK_END)
            if end < 0:
                hold = 0 if final else partial_suffix(self.pending, THINK_END)
                reasoning, self.pending = self.pending[: len(self.pending) - hold], self.pending[
                    len(self.pending) - hold:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:end], self.pending[end + len(THINK_END):]
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

