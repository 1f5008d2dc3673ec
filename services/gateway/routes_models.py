"""GET /v1/models, /health (the process answers) and /ready (a worker can serve)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway import errors
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.schemas import ERROR_RESPONSES, ModelList
from kvrelay.gateway.tenants import Tenant

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def models(request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    backend = gateway_of(request).backend
    name = backend.model_name
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvrelay",
             "max_model_len": backend.max_model_len}] if tenant.may_use(name) else []
    return {"object": "list", "data": data}


@router.get("/health", responses={503: ERROR_RESPONSES[503]})
async def health(request: Request):
    alive = getattr(gateway_of(request).backend, "alive", None)
    if alive is not None and not alive():  # the in-process engine's step loop is hung (watchdog)
        raise errors.unavailable("The engine's step loop is hung", "engine_hung", retry_after=None)
    return {"status": "ok"}


@router.get("/ready", responses={503: ERROR_RESPONSES[503]})
async def ready(request: Request):
    backend = gateway_of(request).backend
    if not backend.ready():
        raise errors.unavailable("No healthy workers", "no_healthy_workers")
    return {"status": "ready", "model": backend.model_name}
