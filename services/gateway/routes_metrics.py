"""GET /metrics on the API port. The full view, per tenant, is on `--metrics-port` (serve.py).

Here, with a tenants file loaded, it needs a tenant's key, and it never shows tenant ids:
series are summed over their tenant label."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from kvrelay.gateway.deps import gateway_of, tenant_of

router = APIRouter()
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request):
    gateway = gateway_of(request)
    if not gateway.tenants.open:
        await tenant_of(request)  # 401 without a valid key
    return Response(gateway.metrics.exposition(per_tenant=False), media_type=CONTENT_TYPE)
