"""GET /metrics on the API port (the metrics port serves its own, see metrics_server.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from kvrelay.gateway.deps import gateway_of

router = APIRouter()
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request):
    return Response(gateway_of(request).metrics.exposition(), media_type=CONTENT_TYPE)
