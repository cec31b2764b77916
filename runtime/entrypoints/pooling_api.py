"""The pooling routes, as vLLM serves them: /v1/embeddings (OpenAI), /score, /rerank
(Jina/Cohere shapes, also under /v1 and /v2) and /classify; and the check that keeps the
generating routes away from a pooling model (and these routes away from a generating one).

Each input is a request of the engine core, which batches it with the other requests in flight
(`AsyncLLM.encode`)."""
from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from runtime.engine.async_llm import AsyncLLM, EngineRestartingError, QueueFullError
from runtime.entrypoints.errors import bad_request
from runtime.entrypoints.protocol import Bool, Count, RequestBody, Text, TokenId
from runtime.entrypoints.serving import (ServerState, check_model, engine_error, new_id,
                                         state_of)
from runtime.pooling.params import PoolingParams
from runtime.pooling.processor import PoolingInput, PoolingProcessor

router = APIRouter()

TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Input = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | \
    Annotated[list[TokenIds], Field(min_length=1)]
# -1 (the model's limit) or keep the last k >= 1 tokens
Truncate = Literal[-1] | Annotated[int, Field(strict=True, ge=1)]


class EmbeddingRequest(RequestBody):
    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncate | None = None


class ClassificationRequest(RequestBody):
    input: Input
    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None


class ScoreRequest(RequestBody):
    text_1: Text | Annotated[list[Text], Field(min_length=1)]
    text_2: Text | Annotated[list[Text], Field(min_length=1)]
    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None


class RerankRequest(RequestBody):
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    model: str | None = None
    top_n: Annotated[int, Field(strict=True, ge=0)] | None = None  # None or 0: all
    return_documents: Bool = True
    truncate_prompt_tokens: Truncate | None = None


async def generation_only(raw: Request) -> None:
    """Router dependency of the generating APIs: a pooling model answers their POSTs 400."""
    engine = state_of(raw).engine
    if raw.method == "POST" and getattr(engine, "pooling", None) is not None:
        raise bad_request(f"this model is a pooling model (embeddings, scoring, "
                          f"classification) and does not generate: {raw.url.path} is not "
                          f"served; use /v1/embeddings, /score, /rerank or /classify")


def _pooling(state: ServerState, route: str) -> PoolingProcessor:
    if state.engine.pooling is None:
        raise bad_request(f"this model generates text; {route} needs a pooling model "
                          f"(serve one with --runner pooling)")
    return state.engine.pooling


def _prompts(value: Any) -> list:
    """One input or a batch: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str) or isinstance(value[0], int):
        value = [value]
    return [{"prompt_token_ids": v} if isinstance(v, list) else v for v in value]


def _params(**fields: Any) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), param=next((f for f in fields if f in str(e)), None)) from None


def _checked(prepare, *args: Any) -> list[PoolingInput]:
    """The engine inputs `prepare` makes of `args`; a bad input is a 400."""
    try:
        return prepare(*args)
    except ValueError as e:
        raise bad_request(str(e)) from None


async def _encode(state: ServerState, inputs: list[PoolingInput], param: str) -> list:
    """The engine's results for `inputs`; a full queue or a restarting core is a 503, more
    inputs than may ever wait a 400 naming `param`."""
    engine: AsyncLLM = state.engine
    if len(inputs) > engine.max_queue_len:
        raise bad_request(f"this request has {len(inputs)} inputs, but at most "
                          f"{engine.max_queue_len} may wait (--max-queue-len)", param=param)
    try:
        return await engine.encode(inputs)
    except (QueueFullError, EngineRestartingError) as e:
        raise engine_error(state, e) from None


async def _pool_inputs(raw: Request, body: EmbeddingRequest | ClassificationRequest, route: str,
                       task: str, params: PoolingParams
                       ) -> tuple[str, PoolingProcessor, list[PoolingInput], list]:
    """The reported model name, the model's pooling processor, and the engine's inputs and
    results for each of `body.input`."""
    state = state_of(raw)
    model = check_model(state, body.model)
    pooling = _pooling(state, route)
    prompts = _prompts(body.input)
    inputs = _checked(pooling.inputs, prompts, [params] * len(prompts), task)
    return model, pooling, inputs, await _encode(state, inputs, "input")


def _usage(outputs: list) -> dict:
    n = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": n, "total_tokens": n}


def _encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, raw: Request) -> dict:
    params = _params(dimensions=body.dimensions,
                     truncate_prompt_tokens=body.truncate_prompt_tokens)
    model, pooling, inputs, results = await _pool_inputs(raw, body, "/v1/embeddings", "embed",
                                                         params)
    outputs = pooling.embedding_outputs(inputs, results)
    data = [{"object": "embedding", "index": i,
             "embedding": _encode_vector(o.outputs.embedding, body.encoding_format)}
            for i, o in enumerate(outputs)]
    return {"id": new_id("embd"), "object": "list", "created": int(time.time()),
            "model": model, "data": data, "usage": _usage(outputs)}


@router.post("/classify")
@router.post("/v1/classify")
async def create_classification(body: ClassificationRequest, raw: Request) -> dict:
    params = _params(truncate_prompt_tokens=body.truncate_prompt_tokens)
    model, pooling, inputs, results = await _pool_inputs(raw, body, "/classify", "classify",
                                                         params)
    outputs = pooling.classification_outputs(inputs, results)
    labels = getattr(state_of(raw).engine.hf_config, "id2label", None) or {}
    data = []
    for i, o in enumerate(outputs):
        probs = o.outputs.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels.get(best, str(best)), "probs": probs,
                     "num_classes": len(probs)})
    return {"id": new_id("classify"), "object": "list", "created": int(time.time()),
            "model": model, "data": data, "usage": _usage(outputs)}


async def _score(raw: Request, model: str | None, route: str, first: str | list[str],
                 second: str | list[str], truncate: int | None,
                 second_param: str) -> tuple[str, list]:
    """The reported model name and the scores of the pairs (first[i], second[i]); one `first`
    goes with every `second` (the request field `second_param`)."""
    state = state_of(raw)
    model = check_model(state, model)
    pooling = _pooling(state, route)
    first = [first] if isinstance(first, str) else first
    second = [second] if isinstance(second, str) else second
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise bad_request(f"scoring takes one text and a list, or two lists of one length; "
                          f"got {len(first)} and {len(second)}")
    inputs = _checked(pooling.score_inputs, first, second,
                      _params(truncate_prompt_tokens=truncate))
    return model, pooling.scoring_outputs(inputs, await _encode(state, inputs, second_param))


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, raw: Request) -> dict:
    model, outputs = await _score(raw, body.model, "/score", body.text_1, body.text_2,
                                  body.truncate_prompt_tokens, "text_2")
    data = [{"index": i, "object": "score", "score": o.outputs.score}
            for i, o in enumerate(outputs)]
    return {"id": new_id("score"), "object": "list", "created": int(time.time()),
            "model": model, "data": data, "usage": _usage(outputs)}


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, raw: Request) -> dict:
    model, outputs = await _score(raw, body.model, "/rerank", body.query, body.documents,
                                  body.truncate_prompt_tokens, "documents")
    ranked = sorted(range(len(outputs)), key=lambda i: -outputs[i].outputs.score)
    if body.top_n:
        ranked = ranked[:body.top_n]
    results = [{"index": i, "relevance_score": outputs[i].outputs.score,
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
               for i in ranked]
    return {"id": new_id("rerank"), "model": model,
            "usage": {"total_tokens": _usage(outputs)["total_tokens"]}, "results": results}
