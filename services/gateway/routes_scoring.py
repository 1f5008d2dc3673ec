"""vLLM's score (/score, /v1/score) and rerank (/rerank, /v1/rerank, /v2/rerank) APIs on an
embedding model, and its classification API (/classify, /v1/classify) on a sequence classifier
(kvrelay serve --runner pooling)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from kvrelay.gateway.classify import ClassifyResponse, prepare_classify
from kvrelay.gateway.deps import gateway_of, tenant_of
from kvrelay.gateway.schemas import ERROR_RESPONSES, ClassifyRequest, RerankRequest, ScoreRequest
from kvrelay.gateway.scoring import ScoringResponse, prepare_scoring
from kvrelay.gateway.tenants import Tenant

router = APIRouter()


async def _answer(body: ScoreRequest | RerankRequest, request: Request, tenant: Tenant) -> ScoringResponse:
    gateway = gateway_of(request)
    prepared = await prepare_scoring(gateway, body, tenant)
    await gateway.admit(prepared)
    return ScoringResponse(gateway, prepared, body)


@router.post("/score", responses=ERROR_RESPONSES)
@router.post("/v1/score", responses=ERROR_RESPONSES)
async def score(body: ScoreRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    return await _answer(body, request, tenant)


@router.post("/rerank", responses=ERROR_RESPONSES)
@router.post("/v1/rerank", responses=ERROR_RESPONSES)
@router.post("/v2/rerank", responses=ERROR_RESPONSES)
async def rerank(body: RerankRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    return await _answer(body, request, tenant)


@router.post("/classify", responses=ERROR_RESPONSES)
@router.post("/v1/classify", responses=ERROR_RESPONSES)
async def classify(body: ClassifyRequest, request: Request, tenant: Annotated[Tenant, Depends(tenant_of)]):
    gateway = gateway_of(request)
    prepared = await prepare_classify(gateway, body, tenant)
    await gateway.admit(prepared)
    return ClassifyResponse(gateway, prepared)
