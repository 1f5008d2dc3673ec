"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), served only with
`--allow-runtime-lora-updating`: LoRA adapters loaded and unloaded while the server runs
(kvrelay.engine.lora.runtime). Such a server loads any folder its callers name, so it runs without
a tenants file (serve.py refuses the combination): keep it behind --api-key and off public networks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from kvrelay.gateway import errors
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.tenants import Tenant
from pydantic import BaseModel, ConfigDict, Field

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^\S+$")]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None  # vLLM's; names identify adapters here


async def _apply(op) -> None:
    from kvrelay.engine.lora.runtime import LoRAUpdateError

    try:
        await op
    except LoRAUpdateError as e:
        if e.status == 404:
            raise errors.ApiError(404, str(e), "not_found_error", "lora_name", "lora_not_found") from e
        raise errors.ApiError(e.status, str(e), "invalid_request_error", "lora_name") from e


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRARequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    backend = gateway_of(request).backend
    if body.lora_name == backend.model_name:
        raise errors.bad_request(f"{body.lora_name!r} is the base model's name", "lora_name")
    await _apply(backend.load_lora(body.lora_name, body.lora_path))
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request,
                              tenant: Annotated[Tenant, Depends(tenant_of)]):
    await _apply(gateway_of(request).backend.unload_lora(body.lora_name))
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
