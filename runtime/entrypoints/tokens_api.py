"""vLLM's token-in, token-out routes: `/inference/v1/generate` (token ids in, the sampled token
ids out, for routers and RL loops that tokenize themselves; vLLM's GenerateRequest and
GenerateResponse shapes) and `/abort_requests`."""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, TypeAdapter, ValidationError

from runtime.engine.async_llm import RequestStream
from runtime.entrypoints.errors import bad_request
from runtime.entrypoints.protocol import (Bool, Int64, RequestBody, StreamOptions, Text,
                                          TokenId, only)
from runtime.entrypoints.serving import (check_model, final_outputs, new_id, open_streams, sse,
                                         state_of, stream_error, unless_disconnected)
from runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.structured_output.params import StructuredOutputsParams

router = APIRouter()


def _public_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))


SAMPLING_FIELDS = _public_fields(SamplingParams)
STRUCTURED_FIELDS = _public_fields(StructuredOutputsParams)
_SAMPLING = TypeAdapter(SamplingParams)  # types checked, then SamplingParams' own checks


class GenerateRequest(RequestBody):
    request_id: Text | None = None  # the engine's id for it (default: a new unique one)
    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: dict[str, Any] = Field(default_factory=dict)  # SamplingParams' fields
    model: str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0
    # vLLM's fields for what this server does not do: a 400 names them
    features: only() = None  # multimodal inputs
    cache_salt: only() = None
    kv_transfer_params: only() = None


class AbortRequestsRequest(RequestBody):
    request_ids: list[Text]


def sampling_params(given: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a request's `sampling_params` object, the generation config's
    `defaults` filling what it leaves out; a 400 names an unknown field or a bad value."""
    unknown = sorted(set(given) - set(SAMPLING_FIELDS))
    structured = given.get("structured_outputs")
    if isinstance(structured, dict):
        unknown += [f"structured_outputs.{k}" for k in sorted(set(structured) -
                                                               set(STRUCTURED_FIELDS))]
    if unknown:
        raise bad_request(f"sampling_params has no field {', '.join(unknown)}; its fields: "
                          f"{', '.join(SAMPLING_FIELDS)}", param="sampling_params")
    try:
        params = _SAMPLING.validate_python({**defaults, **given})
    except ValidationError as e:
        problems = "; ".join(".".join(["sampling_params", *map(str, err["loc"])]) + ": " +
                             err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise bad_request(f"invalid request: {problems}", param="sampling_params") from None
    if params.n != 1 or params.num_samples != 1:
        raise bad_request("sampling_params.n and best_of must be 1 on /inference/v1/generate "
                          "(as vLLM's): send one request per sample", param="sampling_params")
    return params


def _token(token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else f"token_id:{token_id}"


def _logprobs(sample: CompletionOutput, top: int) -> dict:
    """The sampled tokens' logprobs in the chat completions' shape (vLLM's
    ChatCompletionLogProbs)."""
    def entry(token_id: int, p: Any) -> dict:
        token = _token(token_id, p.decoded_token)
        return {"token": token, "logprob": p.logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, position in zip(sample.token_ids, sample.logprobs or []):
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top]
        content.append({**entry(token_id, position[token_id]),
                        "top_logprobs": [entry(t, p) for t, p in ranked]})
    return {"content": content}


def _choice(sample: CompletionOutput, params: SamplingParams) -> dict:
    return {"index": sample.index, "token_ids": sample.token_ids,
            "finish_reason": sample.finish_reason,
            "logprobs": None if params.logprobs is None else _logprobs(sample, params.logprobs)}


def _prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt position, token id -> Logprob (None first)."""
    if positions is None:
        return None
    return [None if p is None else {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in p.items()} for p in positions]


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, raw: Request) -> Any:
    state = state_of(raw)
    model = check_model(state, body.model)  # an adapter's name picks that adapter
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options needs stream=true", param="stream_options")
    params = sampling_params(body.sampling_params, state.engine.processor.sampling_defaults)
    request_id = body.request_id or new_id("generate")
    if request_id in state.engine.streams:
        raise bad_request(f"request_id {request_id!r} is already in flight",
                          param="request_id")
    streams = await open_streams(state, request_id, [{"prompt_token_ids": body.token_ids}],
                                 params, body.stream, body.priority,
                                 "sampling_params.max_tokens", model=model, raw=raw)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_chunks(request_id, streams[0], params, usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    output: RequestOutput = (await unless_disconnected(raw, final_outputs(streams),
                                                       streams))[0]
    return {"request_id": request_id,
            "choices": [_choice(sample, params) for sample in output.outputs],
            "prompt_logprobs": _prompt_logprobs(output.prompt_logprobs),
            "kv_transfer_params": None}


async def _chunks(request_id: str, stream: RequestStream, params: SamplingParams,
                  usage: bool) -> AsyncIterator[str]:
    """One event per step's new tokens (vLLM's GenerateStreamResponse), the usage last if
    asked, then [DONE]; an error event in place of the rest if anything fails."""
    try:
        async for output in stream:
            yield sse({"request_id": request_id,
                       "choices": [_choice(s, params) for s in output.outputs]})
        if usage:
            yield sse({"request_id": request_id, "choices": [], "usage": {
                "prompt_tokens": stream.num_prompt_tokens,
                "completion_tokens": stream.num_output_tokens,
                "total_tokens": stream.num_prompt_tokens + stream.num_output_tokens}})
    except Exception as e:
        yield sse(stream_error(e, request_id).body())
    finally:
        stream.close()
    yield sse("[DONE]")


@router.post("/abort_requests", response_class=Response)
async def abort_requests(body: AbortRequestsRequest, raw: Request) -> Response:
    """End requests by the ids their responses carry (finished or unknown ones are skipped);
    each ends with finish_reason "abort"."""
    engine = state_of(raw).engine
    for request_id in body.request_ids:
        engine.abort(request_id)
    return Response(status_code=200)
