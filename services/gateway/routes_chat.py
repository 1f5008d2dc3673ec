"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.response import GenerationResponse
from kvrelay.gateway.schemas import GENERATION_RESPONSES, ChatCompletionRequest, ChatCompletionResponse
from kvrelay.gateway.tenants import Tenant

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    prepared = await gateway.prepare_chat(body, tenant)
    await gateway.admit(prepared)
    return GenerationResponse(gateway, prepared)
