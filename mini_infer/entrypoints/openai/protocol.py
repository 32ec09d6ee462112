"""The OpenAI API's request bodies (completions, chat completions) with vLLM's extra sampling fields, and vLLM's
/tokenize and /detokenize bodies.

Fields OpenAI defines that mini-infer does not implement are refused with a 400 naming them when set to
anything but their default; unknown fields are ignored, as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mini_infer.engine.input_processor import check_text
from mini_infer.errors import InvalidRequestError
from mini_infer.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)  # no "true" for true, no 1 for true

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    # Strict: JSON's own types only ("10" is not an integer, true is not 1); an integer still fills a float field.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the served model
    temperature: float | None = None  # None: the model's generation_config.json, as vLLM does
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _checks(self):
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError("best_of > n cannot stream (the best completions are known only at the end)",
                                      "best_of")
        return self

    logit_bias: dict[str, float] | None = None  # token id (as JSON object keys are: a string) -> bias

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams: fields it sets over the model's defaults (InvalidRequestError if bad)."""
        chosen = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                          "repetition_penalty", "presence_penalty",
                                                          "frequency_penalty") if getattr(self, name) is not None}
        return replace(defaults, **chosen, n=self.n, best_of=self.best_of, seed=self.seed, max_tokens=max_tokens,
                       min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop,
                       stop_token_ids=self.stop_token_ids, logprobs=logprobs,
                       include_stop_str_in_output=self.include_stop_str_in_output,
                       skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias())

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                          "logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(description="one prompt: text or token ids")
    max_tokens: int | None = 16  # OpenAI's default; None: up to max_model_len
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported by this server", "suffix")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ...: passed to the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        for value in message.values():
            if isinstance(value, str):
                check_text(value, "messages")
        if isinstance(self.content, list):  # text parts only
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError("only text content parts ({'type': 'text', 'text': ...}) are "
                                              "supported", "messages")
                check_text(part["text"], "messages")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra field
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.response_format not in (None, {"type": "text"}):
            raise InvalidRequestError("response_format other than {'type': 'text'} is not supported",
                                      "response_format")
        if self.tools is not None:
            raise InvalidRequestError("tools is not supported by this server", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the model's chat template first."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template has them)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if self.prompt is not None:
            check_text(self.prompt, "prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]
