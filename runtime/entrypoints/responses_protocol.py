"""The request body of the OpenAI Responses API (/v1/responses), and what it means in the terms
of the chat route: template messages, a `ToolChoice`, `SamplingParams`.

Every official field is declared; one the server does not honour (a stored conversation,
background runs, reasoning, built-in tools, ...) is refused with a 400 naming it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from runtime.entrypoints.protocol import (Body, Bool, ChatMessage, Count, Float,
                                          FunctionDefinition, ReasoningEffort, RequestBody,
                                          make_sampling_params, only)
from runtime.entrypoints.structured import checked
from runtime.entrypoints.tool_parsers import ToolChoice
from runtime.sampling_params import SamplingParams


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    type: Literal["output_text"]
    text: str


class InputImage(Body):
    """An image by URL (data:, or http(s):// and file:// where the server allows them)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"  # the model's processor decides the size


Part = Annotated[Union[InputText, OutputText, InputImage], Field(discriminator="type")]


class MessageItem(Body):
    """A message; `type` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Part]]


class FunctionCallItem(Body):
    """A call the model made earlier, given back with its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]


def _item_type(item: Any) -> Any:
    return item.get("type", "message") if isinstance(item, dict) else \
        getattr(item, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_type)]


class FunctionTool(Body):
    """A function tool (the built-in ones, web_search and the like, are refused)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None  # calls forced by tool_choice always follow the parameters
    allowed_callers: only(["direct"]) = None
    async_: only(False) = Field(default=None, alias="async")
    defer_loading: only(False) = None
    output_schema: only() = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextPlain(Body):
    type: Literal["text"]


class TextJsonObject(Body):
    type: Literal["json_object"]


class TextJsonSchema(Body):
    type: Literal["json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: Bool | None = None  # the schema is always enforced, strict or not


class TextConfig(Body):
    format: Annotated[Union[TextPlain, TextJsonObject, TextJsonSchema],
                      Field(discriminator="type")] | None = None
    verbosity: only() = None


class ReasoningConfig(Body):
    effort: ReasoningEffort | None = None  # reasoning_effort, where the template reads it
    summary: only() = None  # no summaries are written
    generate_summary: only() = None
    context: only() = None  # earlier turns' reasoning goes back as the template renders it
    mode: only() = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    stream: Bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Bool = True
    # no built-in tool ever runs here, so a limit on their calls always holds
    max_tool_calls: Annotated[int, Field(strict=True, ge=0)] | None = None
    # labels with no effect on the output
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # official fields this server does not honour: a 400 names them
    access_programs: only() = None
    background: only(False) = None
    background_options: only() = None
    context_management: only() = None
    conversation: only() = None  # (no stored conversations)
    image: only() = None
    include: only([]) = None
    moderation: only() = None
    previous_response_id: only() = None  # (no stored responses)
    prompt: only() = None
    prompt_cache_options: only() = None
    prompt_cache_retention: only() = None
    reasoning: ReasoningConfig | None = None
    service_tier: only("auto", "default") = None
    store: only(False) = None
    stream_options: only({}, {"include_obfuscation": False}) = None
    top_logprobs: only(0) = None
    truncation: only("disabled") = None

    def chat_messages(self) -> list[ChatMessage]:
        """`instructions` and `input` as chat messages: developer messages become system ones,
        a function_call joins the assistant message before it, its output is a tool message."""
        messages = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [ChatMessage(role="user", content=self.input)]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(
                    role="system" if item.role == "developer" else item.role,
                    content=_content(item.content)))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is None or last.role != "assistant":
                    last = ChatMessage(role="assistant", content="", tool_calls=[])
                    messages.append(last)
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                            content=_text(item.output)))
        return messages

    def tool_choice_of(self, parser: str | None, auto_enabled: bool) -> ToolChoice:
        tools = [{"type": "function", "function": FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters).model_dump(
            exclude_none=True)} for t in self.tools] if self.tools else None
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return ToolChoice(tools, None, parser, auto_enabled, self.parallel_tool_calls,
                              named=choice.name)
        return ToolChoice(tools, choice, parser, auto_enabled, self.parallel_tool_calls)

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (the --generation-config ones) fill the fields the request leaves out;
        `text.format` constrains the output as chat's `response_format` does."""
        fields: dict[str, Any] = {**(defaults or {})}
        if self.max_output_tokens is not None or "max_tokens" not in fields:
            fields["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        text_format = self.text.format if self.text is not None else None
        if isinstance(text_format, TextJsonObject):
            fields["structured_outputs"] = checked("text", {"json_object": True})
        elif isinstance(text_format, TextJsonSchema):
            fields["structured_outputs"] = checked("text", {"json": text_format.json_schema})
        return make_sampling_params(**fields)

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "max_tool_calls": self.max_tool_calls, "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": self.reasoning.effort, "summary": None}
                if self.reasoning is not None else None, "service_tier": "default", "store": False,
                "temperature": self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "truncation": "disabled",
                "text": self.text.model_dump(by_alias=True, exclude_none=True)
                if self.text is not None and self.text.format is not None
                else {"format": {"type": "text"}},
                "tool_choice": self.tool_choice.model_dump()
                if isinstance(self.tool_choice, FunctionChoice)
                else self.tool_choice or ("auto" if self.tools else "none"),
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "user": self.user}


def _text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _content(content: str | list) -> str | list[dict[str, Any]]:
    """A message's content for the chat route: its text, or its parts where it has images."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _text(content)
    for part in content:
        if isinstance(part, InputImage) and part.image_url is None:
            raise ValueError("an input_image needs image_url: file_id (uploaded files) is not "
                             "supported")
    return [{"type": "input_image", "image_url": p.image_url} if isinstance(p, InputImage)
            else {"type": "text", "text": p.text} for p in content]
