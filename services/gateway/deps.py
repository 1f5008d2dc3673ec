"""FastAPI dependencies shared by the routers: the gateway and the authenticated tenant."""

from __future__ import annotations

from fastapi import Request
from kvrelay.gateway import errors
from kvrelay.gateway.access_log import access_fields
from kvrelay.gateway.gateway import Gateway
from kvrelay.gateway.tenants import Tenant, key_from_headers


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


async def tenant_of(request: Request) -> Tenant:  # async: sync dependencies hop to a thread pool
    tenant = gateway_of(request).tenants.authenticate(key_from_headers(request.headers))
    if tenant is None:
        raise errors.unauthorized("Missing or incorrect API key: send it as `Authorization: Bearer <key>` "
                                  "or in an `x-api-key` header")
    access_fields(request.scope)["tenant"] = tenant.id
    return tenant
