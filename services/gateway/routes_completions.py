"""POST /v1/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.response import GenerationResponse
from kvrelay.gateway.schemas import GENERATION_RESPONSES, CompletionRequest, CompletionResponse
from kvrelay.gateway.tenants import Tenant

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    prepared = await gateway.prepare_completion(body, tenant)
    await gateway.admit(prepared)
    return GenerationResponse(gateway, prepared)
