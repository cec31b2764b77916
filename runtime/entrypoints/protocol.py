"""Request bodies of the OpenAI and Anthropic APIs, and how they map onto `SamplingParams`.

Unknown fields are ignored (clients send fields this server has no use for). Besides the
official fields, the OpenAI routes take vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...), which clients pass in `extra_body`.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from runtime.entrypoints.errors import bad_request
from runtime.sampling_params import SamplingParams


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # not supported: refused when given
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int = 0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; a bad value is a 400 naming the parameter."""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        fields: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens, "logprobs": logprobs,
                                  "prompt_logprobs": prompt_logprobs}
        for name in ("temperature", "top_p", "stop", "seed", "presence_penalty",
                     "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                     "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                     "skip_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return make_sampling_params(**fields)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # not supported: refused when given


class ChatMessage(Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class MessagesRequest(Body):
    """The Anthropic Messages API."""

    model: str
    messages: list[AnthropicMessage]
    max_tokens: int
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        fields: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": self.stop_sequences}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return make_sampling_params(**fields)


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def make_sampling_params(**fields: Any) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
