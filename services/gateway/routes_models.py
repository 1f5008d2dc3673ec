"""GET /v1/models (and one model, as the OpenAI client's `models.retrieve` asks), /health (the
process answers), /ready (a worker can serve) and /version."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway import errors
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.model_names import may_use, served_names
from kvrelay.gateway.schemas import ERROR_RESPONSES, ModelCard, ModelList
from kvrelay.gateway.tenants import Tenant

router = APIRouter()


def _card(backend, model: str) -> dict:
    """The served model's card, or a LoRA adapter's (with its folder and the model it runs on, as vLLM)."""
    card = {"id": model, "object": "model", "created": 0, "owned_by": "kvrelay", "max_model_len": backend.max_model_len}
    if model in backend.lora_modules:
        card.update(root=str(backend.lora_modules[model]), parent=backend.model_name)
    return card


@router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True,
            responses={401: ERROR_RESPONSES[401]})
async def models(request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    backend = gateway_of(request).backend
    return {"object": "list", "data": [_card(backend, m) for m in served_names(backend)
                                       if may_use(backend, tenant, m)]}


@router.get("/v1/models/{model:path}", response_model=ModelCard, response_model_exclude_none=True,
            responses={k: ERROR_RESPONSES[k] for k in (401, 403, 404)})
async def model(model: str, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    gateway.check_model(model, tenant)  # 404 naming the models served, or 403 for a model the tenant may not use
    return _card(gateway.backend, model)


@router.get("/version")
async def version():
    from kvrelay import __version__

    return {"version": __version__}


@router.get("/health", responses={503: ERROR_RESPONSES[503]})
async def health(request: Request):
    alive = getattr(gateway_of(request).backend, "alive", None)
    if alive is not None and not alive():  # the in-process engine's step loop is hung (watchdog)
        raise errors.unavailable("The engine's step loop is hung", "engine_hung", retry_after=None)
    return {"status": "ok"}


@router.get("/ready", responses={503: ERROR_RESPONSES[503]})
async def ready(request: Request):
    gateway = gateway_of(request)
    backend = gateway.backend
    if gateway.draining:  # stopping: load balancers take this gateway out while it still serves
        raise errors.unavailable("Shutting down: this gateway serves what it gets but takes nothing new soon",
                                 "draining", retry_after=None)
    if not backend.ready():
        raise errors.unavailable("No healthy workers", "no_healthy_workers")
    return {"status": "ready", "model": backend.model_name}
