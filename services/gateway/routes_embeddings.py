"""POST /v1/embeddings (served by a pooling engine: kvrelay serve --runner pooling)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.embeddings import EmbeddingsResponse, prepare_embedding
from kvrelay.gateway.schemas import ERROR_RESPONSES, EmbeddingRequest, EmbeddingResponse
from kvrelay.gateway.tenants import Tenant

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    prepared = await prepare_embedding(gateway, body, tenant)
    await gateway.admit(prepared)
    return EmbeddingsResponse(gateway, prepared, body.encoding_format)
