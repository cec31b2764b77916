"""Request bodies of the OpenAI and Anthropic APIs, and how they map onto `SamplingParams`.

Every official field is declared: one the server does not honour is declared with `only`, which
refuses it with a 400 naming it. Besides the official fields, the OpenAI routes take vLLM's
extras (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
...), which clients pass in `extra_body`; vLLM's extras not honoured here are refused the same
way. A request body's unknown fields are a 400 naming them (`RequestBody`); objects inside it
(a message, a tool) ignore theirs, as the clients send back what a response held.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from runtime.beam_search import BeamSearchParams
from runtime.entrypoints.errors import bad_request
from runtime.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams

# JSON numbers as the engine takes them: integers are never booleans or floats, and fit int64;
# floats are finite numbers (an integer passes; a boolean or a string does not). Limits that
# depend on the model (the vocabulary, the context) are checked after tokenization and answered
# with a 400 that names them.
Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Logprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Text = Annotated[str, Field(min_length=1)]
Bool = Annotated[bool, Field(strict=True)]  # true or false, never 0 or "yes"
# OpenAI's reasoning_effort values: the template decides what each means
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TOKEN_ID_TEXT = re.compile(r"[0-9]{1,19}")  # a logit_bias key: int64 at most, no "²" or "٣"
# Each banned word is tokenized per request and its tokens checked at every step of the batch.
MAX_BAD_WORDS = 1024


def only(*accepted: Any) -> Any:
    """A field of the official API this server does not honour: absent, null or one of
    `accepted` (values that ask for nothing) it passes; otherwise a 400 names it."""
    def check(value: Any) -> Any:
        if value is not None and value not in accepted:
            raise ValueError(f"not supported by this server (accepted: "
                             f"{', '.join(map(repr, (None, *accepted)))})")
        return value
    return Annotated[Any, BeforeValidator(check)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(Body):
    """A route's whole body: a field it does not define is refused, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
    include_usage: Bool = False
    include_obfuscation: only(False) = None  # no obfuscation padding is sent


class JsonSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: Count = 1
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    stop: Text | list[Text] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)] | None = None
    ignore_eos: Bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    priority: Int64 = 0
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: Annotated[list[Text], Field(max_length=MAX_BAD_WORDS)] | None = None
    structured_outputs: dict[str, Any] | None = None
    # disaggregated prefill: what the KV connector is to do (docs/kv_connectors.md)
    kv_transfer_params: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras this server does not honour: a 400 names them
    guided_decoding_backend: only() = None  # the server's --structured-outputs-config decides
    guided_whitespace_pattern: only() = None
    logits_processors: only() = None
    prompt_logprobs: only() = None  # completions: echo with logprobs gives them
    return_token_ids: only(False) = None
    return_tokens_as_token_ids: only(False) = None
    spaces_between_special_tokens: only(True) = None
    truncate_prompt_tokens: only() = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; a bad value is a 400 naming the parameter. `defaults`
        (the --generation-config ones) fill the fields the request leaves out."""
        from runtime.entrypoints.structured import structured_outputs_of
        self.check_stream_options()
        fields: dict[str, Any] = dict(defaults or {})
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not TOKEN_ID_TEXT.fullmatch(k.strip())]
            if bad:
                raise bad_request("logit_bias keys must be token ids (strings of at most 19 "
                                  f"ASCII digits), got {[k[:30] for k in bad[:3]]}",
                                  param="logit_bias")
            fields["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        fields["structured_outputs"] = structured_outputs_of(self)
        if max_tokens is not None or "max_tokens" not in fields:
            fields["max_tokens"] = max_tokens
        fields.update(n=self.n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if self.kv_transfer_params is not None:
            if self.stream and self.kv_transfer_params.get("do_remote_decode"):
                raise bad_request("kv_transfer_params.do_remote_decode needs stream=false: the "
                                  "params for the decode instance come in the response body",
                                  param="kv_transfer_params")
            fields["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        for name in ("temperature", "top_p", "stop", "seed", "presence_penalty",
                     "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                     "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                     "skip_special_tokens", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return make_sampling_params(**fields)

    def check_stream_options(self) -> None:
        """As OpenAI and vLLM: stream_options without stream is a 400 (never ignored)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options needs stream=true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # "" or absent only beside prompt_embeds (the clients send "" with them, as vLLM's docs do)
    prompt: Union[Text, Annotated[list[Text], Field(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1)], Literal[""], None] = None
    # vLLM's extra (--enable-prompt-embeds): base64 of torch.save()d [tokens, hidden] tensors,
    # served before the prompts
    prompt_embeds: Union[Text, Annotated[list[Text], Field(min_length=1)], None] = None
    max_tokens: Count | None = 16
    logprobs: Logprobs | None = None
    echo: Bool = False
    suffix: str | None = None  # not supported: refused when given
    add_special_tokens: only(True) = None  # the prompt's text is tokenized with them
    best_of: Count | None = None  # sample best_of, return the best n; with beam search: width
    # vLLM's beam search extras
    use_beam_search: Bool = False
    length_penalty: Float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        for name, neutral in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(self, name) != neutral:
                raise bad_request(f"{name} applies to use_beam_search only (it would be "
                                  "ignored)", param=name)
        params = super().sampling_params(max_tokens, logprobs, prompt_logprobs, defaults)
        if self.best_of is None:
            return params
        if self.stream and self.best_of > self.n:
            raise bad_request("best_of > n cannot be streamed: the best samples are known "
                              "only at the end", param="best_of")
        try:
            return params.clone(best_of=self.best_of)
        except ValueError as e:
            raise bad_request(str(e), param="best_of") from None

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """The beam search this request asks for (use_beam_search): width best_of, else n.
        Sampling options have no place in it: a 400 names the one given."""
        self.check_stream_options()
        for name, neutral in (("temperature", 0), ("top_p", 1), ("top_k", -1), ("min_p", 0),
                              ("seed", None), ("presence_penalty", 0),
                              ("frequency_penalty", 0), ("repetition_penalty", 1),
                              ("min_tokens", 0), ("logprobs", None), ("stop", None),
                              ("stop_token_ids", None)):
            value = getattr(self, name)
            if value is not None and value != neutral and not (name == "top_k" and value == 0):
                raise bad_request(f"{name}={value!r} is not supported with use_beam_search, "
                                  "which always takes the most likely continuations",
                                  param=name)
        if self.stream:
            raise bad_request("use_beam_search cannot be streamed: the best beams are known "
                              "only at the end", param="stream")
        width = self.best_of if self.best_of is not None else self.n
        if self.n < 1 or width < self.n:
            raise bad_request(f"use_beam_search returns n of its best_of beams: need "
                              f"1 <= n <= best_of, got n={self.n}, best_of={self.best_of}",
                              param="n")
        try:
            return BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                    ignore_eos=bool(self.ignore_eos),
                                    length_penalty=self.length_penalty,
                                    early_stopping=self.early_stopping)
        except ValueError as e:
            raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None


class ChatMessage(Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM's field)


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None  # calls forced by tool_choice always follow the parameters


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: Bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: Bool = True
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Bool = True
    # labels with no effect on the output
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's chat extras
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    # a template variable (as vLLM): taken where the chat template reads it, else a 400
    reasoning_effort: ReasoningEffort | None = None
    continue_final_message: Bool = False  # continue the last (assistant) message
    # vLLM's chat extras this server does not honour: a 400 names them
    add_special_tokens: only(False) = None  # the template writes the special tokens
    chat_template: only() = None  # the server's --chat-template decides
    documents: only() = None
    echo: only(False) = None
    # official fields this server does not honour: a 400 names them
    audio: only() = None
    function_call: only("none") = None
    functions: only() = None
    modalities: only(["text"]) = None
    moderation: only() = None
    prediction: only() = None
    prompt_cache_options: only() = None
    prompt_cache_retention: only() = None
    service_tier: only("auto", "default") = None
    store: only(False) = None
    verbosity: only() = None
    web_search_options: only() = None


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class AnthropicTool(Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: Bool | None = None  # calls forced by tool_choice always follow the input_schema
    # a prompt-caching breakpoint: the prefix cache keeps every prefix without being asked
    cache_control: dict[str, Any] | None = None
    # official fields this server does not honour: a 400 names them
    allowed_callers: only(["direct"]) = None
    defer_loading: only(False) = None
    eager_input_streaming: only(False) = None
    input_examples: only() = None


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool = False


class MessagesRequest(RequestBody):
    """The Anthropic Messages API."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    max_tokens: Count
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[Text] | None = None
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT64_MAX)] | None = None
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # official fields this server does not honour: a 400 names them
    thinking: only({"type": "disabled"}) = None
    service_tier: only("auto", "standard_only") = None
    cache_control: only() = None
    container: only() = None
    diagnostics: only() = None
    inference_geo: only() = None
    output_config: only() = None
    speed: only() = None
    user_profile_id: only() = None
    workspace_id: only() = None

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (the --generation-config ones) fill the fields the request leaves out."""
        fields: dict[str, Any] = {**(defaults or {}), "max_tokens": self.max_tokens,
                                  "stop": self.stop_sequences}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return make_sampling_params(**fields)


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


def make_sampling_params(**fields: Any) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None


class CountTokensRequest(RequestBody):
    """Anthropic's /v1/messages/count_tokens: the prompt fields of a Messages request."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # official fields this server does not honour: a 400 names them
    thinking: only({"type": "disabled"}) = None
    cache_control: only() = None
    context_management: only() = None
    mcp_servers: only() = None
    output_config: only() = None
    speed: only() = None
    user_profile_id: only() = None
    workspace_id: only() = None
