"""The run-time LoRA routes, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (mounted
only with `--enable-runtime-lora-updating`). A request picks an adapter by naming it as its
`model`."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from runtime.entrypoints.errors import APIError, bad_request
from runtime.entrypoints.protocol import Int64, RequestBody, Text
from runtime.entrypoints.serving import state_of
from runtime.lora.request import LoRARequest

router = APIRouter()
# a name clients put in `model`: printable, no spaces, not empty
LoRAName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[!-~]+$")]


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: LoRAName
    lora_path: Text


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: LoRAName
    lora_int_id: Int64 | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """Serve one more adapter under `lora_name`, checked now (a 400 says what is wrong)."""
    state = state_of(raw)
    async with state.lora_lock:  # loads one at a time: two of one name cannot both succeed
        if body.lora_name in state.lora_modules or body.lora_name in state.model_names:
            raise bad_request(f"the name {body.lora_name!r} is already served",
                              param="lora_name")
        # ids are never reused: a slot or cached block of an unloaded adapter serves no other
        lora = LoRARequest(body.lora_name, state.next_lora_id, body.lora_path)
        try:
            await state.off_loop(state.engine.processor.check_lora, lora)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        state.next_lora_id += 1
        state.lora_modules[body.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                              raw: Request) -> PlainTextResponse:
    """Stop serving an adapter (requests already running under it finish)."""
    state = state_of(raw)
    if state.lora_modules.pop(body.lora_name, None) is None:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is served",
                       param="lora_name", code="model_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
