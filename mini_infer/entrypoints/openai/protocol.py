"""The OpenAI API's request bodies (completions, chat completions) with vLLM's extra sampling fields, and vLLM's
/tokenize and /detokenize bodies.

Fields OpenAI defines that mini-infer does not implement are refused with a 400 naming them when set to
anything but their default; unknown fields are ignored, as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mini_infer.engine.input_processor import check_text
from mini_infer.entrypoints.openai.tools import (ToolChoice, check_tools, parse_tool_choice, tool_calls_as_objects,
                                                 tool_choice_constraint)
from mini_infer.errors import InvalidRequestError
from mini_infer.sampling_params import SamplingParams, StructuredOutputsParams

# vLLM's older per-constraint fields: field -> the StructuredOutputsParams field it sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


MAX_BATCH_PROMPTS = 256  # prompts one /v1/completions request may list
# apply_chat_template's own arguments, which chat_template_kwargs may not set.
_TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's chat_template_kwargs (variables for the chat template, e.g. {"enable_thinking": false})."""
    taken = sorted(set(kwargs or ()) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields "
                                  "do)", "chat_template_kwargs")
    return kwargs


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)  # no "true" for true, no 1 for true

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)


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
    min_tokens: int | None = None  # None: the model's (generation_config.json's min_new_tokens, else 0)
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
        self.structured_outputs_params()  # refused here, naming the request's own field
        return self

    logit_bias: dict[str, float] | None = None  # token id (as JSON object keys are: a string) -> bias
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def structured_outputs_field(self) -> str | None:
        """The request field that gives the structured-output constraint (at most one may), or None."""
        given = self._constraint_fields()
        return given[0] if given else None

    def _constraint_fields(self) -> list[str]:
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if set(self.structured_outputs or ()) - {"disable_any_whitespace"}:
            given.insert(0, "structured_outputs")
        if self.response_format not in (None, {"type": "text"}):
            given.insert(0, "response_format")
        return given

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint (InvalidRequestError naming the field that is wrong). As in vLLM,
        structured_outputs may also carry only options (disable_any_whitespace) for response_format or a guided_*
        field's constraint."""
        if self.guided_whitespace_pattern is not None:
            raise InvalidRequestError("guided_whitespace_pattern is not supported by the xgrammar backend; use "
                                      "structured_outputs.disable_any_whitespace", "guided_whitespace_pattern")
        given = self._constraint_fields()
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one structured-output constraint (response_format, "
                                      f"structured_outputs or a guided_* field); this request sets "
                                      f"{', '.join(given)}", given[1])
        if not given:
            return None
        field, options = given[0], dict(self.structured_outputs or {})
        if not isinstance(options.get("disable_any_whitespace", False), bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace must be a boolean",
                                      "structured_outputs")
        try:
            if field == "response_format":
                return StructuredOutputsParams(**options, **_response_format(self.response_format))
            if field == "structured_outputs":
                return StructuredOutputsParams(**options)
            return StructuredOutputsParams(**options, **{GUIDED_FIELDS[field]: getattr(self, field)})
        except TypeError as e:  # an unknown key in structured_outputs
            raise InvalidRequestError(f"structured_outputs: {e}", "structured_outputs") from None
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e).replace("SamplingParams.structured_outputs", field, 1), field) from None

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams: fields it sets over the model's defaults (InvalidRequestError if bad)."""
        chosen = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "min_tokens",
                                                          "repetition_penalty", "presence_penalty",
                                                          "frequency_penalty") if getattr(self, name) is not None}
        return replace(defaults, **chosen, n=self.n, best_of=self.best_of, seed=self.seed, max_tokens=max_tokens,
                       ignore_eos=self.ignore_eos, stop=self.stop,
                       stop_token_ids=self.stop_token_ids, logprobs=logprobs,
                       include_stop_str_in_output=self.include_stop_str_in_output,
                       skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
                       structured_outputs=self.structured_outputs_params())

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
    def usage_mode(self) -> str | None:
        """How a stream reports usage (api_server._events): None, "final" or "continuous"."""
        if self.stream_options is None or not self.stream_options.include_usage:
            return None
        return "continuous" if self.stream_options.continuous_usage_stats else "final"


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="one prompt (text or token ids) or a list of them (OpenAI's batch: n choices per prompt)")
    max_tokens: int | None = 16  # OpenAI's default; None: up to max_model_len
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported by this server", "suffix")
        if len(self.prompts) > MAX_BATCH_PROMPTS:
            raise InvalidRequestError(f"prompt: at most {MAX_BATCH_PROMPTS} prompts a request, got "
                                      f"{len(self.prompts)}", "prompt")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or the batch it lists."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


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
        return tool_calls_as_objects(message)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra field
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required or {"type": "function", ...}
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _checks_of_chat(self):
        self.parsed_tool_choice  # noqa: B018 - tools and tool_choice refused here if malformed
        check_template_kwargs(self.chat_template_kwargs)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        return self

    @property
    def parsed_tool_choice(self) -> ToolChoice:
        return parse_tool_choice(self.tool_choice, check_tools(self.tools) if self.tools is not None else None)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A required or named tool_choice's grammar, or the request's own constraint (not both)."""
        constraint = tool_choice_constraint(self.parsed_tool_choice, self.tools, self.parallel_tool_calls)
        if constraint is None:
            return super().structured_outputs_params()
        if self.structured_outputs_field is not None:
            raise InvalidRequestError(f"tool_choice {self.tool_choice!r} constrains the output itself; it cannot be "
                                      f"combined with {self.structured_outputs_field}", "tool_choice")
        # structured_outputs may still carry the option (as for response_format)
        return replace(constraint, disable_any_whitespace=(self.structured_outputs or {}).get(
            "disable_any_whitespace", False))

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _response_format(response_format: dict) -> dict:
    """StructuredOutputsParams' constraint of OpenAI's response_format: {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema, a JSON schema "
                                      "object", "response_format")
        return {"json": spec["schema"]}
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                              "response_format")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the model's chat template first."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template has them)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        check_template_kwargs(self.chat_template_kwargs)
        if self.prompt is not None:
            check_text(self.prompt, "prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]
