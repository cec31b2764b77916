"""The development routes (mounted only with RUNTIME_SERVER_DEV_MODE=1, as vLLM's behind
VLLM_SERVER_DEV_MODE=1): sleep mode (`/sleep`, `/wake_up`, `/is_sleeping`, with
`--enable-sleep-mode`) and `/update_weights`, for RL loops and rolling updates. Each answers
409 while requests are in flight: they are refused, not waited for (see docs/serving.md)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from runtime.engine.async_llm import EngineBusyError, EngineRestartingError
from runtime.entrypoints.errors import APIError, bad_request
from runtime.entrypoints.protocol import RequestBody, Text
from runtime.entrypoints.serving import RETRY_AFTER_S, state_of

router = APIRouter()
DEV_MODE_ENV = "RUNTIME_SERVER_DEV_MODE"


class UpdateWeightsRequest(RequestBody):
    model_path: Text  # a folder (or .gguf file) of the served architecture, on the server


async def _control(call: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Run one of AsyncLLM's sleep-mode or weight calls, its refusals as HTTP errors."""
    try:
        await call(*args)
    except EngineBusyError as e:
        raise APIError(409, str(e), type="invalid_request_error", code="engine_busy") from None
    except EngineRestartingError as e:
        raise APIError(503, f"{e}; retry later", headers={"Retry-After": RETRY_AFTER_S}) from None
    except ValueError as e:
        raise bad_request(str(e)) from None


@router.post("/sleep", response_class=Response)
async def sleep(raw: Request, level: int = 1) -> Response:
    """Free the KV cache (level 1), and the weights too (level 2) until /wake_up."""
    await _control(state_of(raw).engine.sleep, level)
    return Response(status_code=200)


@router.post("/wake_up", response_class=Response)
async def wake_up(raw: Request, tags: list[str] | None = Query(None)) -> Response:
    """Bring back what sleep freed: `tags` weights and/or kv_cache (default: both)."""
    await _control(state_of(raw).engine.wake_up, tags)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(raw: Request) -> dict:
    return {"is_sleeping": state_of(raw).engine.is_sleeping}


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, raw: Request) -> JSONResponse:
    """Serve the weights of `model_path` from now on, without a restart."""
    await _control(state_of(raw).engine.update_weights, body.model_path)
    return JSONResponse({"success": True,
                         "message": f"serving the weights of {body.model_path}"})
