"""The gateway's HTTP API (FastAPI): error mapping, middleware, and the routers.

Routers: routes_completions.py (/v1/completions), routes_chat.py (/v1/chat/completions),
routes_models.py (/v1/models, /health, /ready), routes_metrics.py (/metrics), routes_embeddings.py
(/v1/embeddings), routes_scoring.py (/score, /rerank). The request logic is in gateway.py, the response side in response.py.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from kvrelay.gateway import (
    errors,
    hooks,
    responses_api,
    routes_chat,
    routes_completions,
    routes_embeddings,
    routes_metrics,
    routes_models,
    routes_scoring,
    routes_tokenize,
)
from kvrelay.gateway.access_log import AccessLog
from kvrelay.gateway.drain import CloseWhileDraining
from kvrelay.gateway.errors import ApiError
from kvrelay.gateway.frontdoor import HeaderCountLimit
from kvrelay.gateway.gateway import Gateway, GatewayConfig
from kvrelay.gateway.middleware import BodyLimit
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

__all__ = ["Gateway", "GatewayConfig", "create_app"]

log = logging.getLogger(__name__)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return errors.bad_request(f"The request body is not valid JSON: {first.get('msg')}", None, "invalid_json")
    # Union members add their type names to the location (`prompt.str`): keep the field path.
    path = []
    for part in loc:
        if part == "":  # a JSON key that is the empty string
            path.append(('.' if path else "") + '""')
        elif part.isdigit():
            path.append(f"[{part}]")
        elif part[0].isupper() or "[" in part or part in ("str", "int", "float", "bool", "list", "dict") or \
                part.startswith(("list[", "function-", "constrained-")):
            continue
        else:
            path.append(("." if path else "") + part)
    param = "".join(path) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field (not part of this API)"
    elif first.get("type") == "value_error":  # our validators' own messages, without pydantic's prefix
        msg = msg.removeprefix("Value error, ")
    more = f" ({len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return errors.bad_request(f"{param or 'body'}: {msg}{more}", param, "invalid_value")


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.shutdown()

    app = FastAPI(title="kvrelay gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat with tenant quotas and fair queueing.")
    app.state.gateway = gateway
    hooks.install(app, gateway.metrics.registry, gateway.config.max_body_bytes)  # plugin request/response hooks

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        gateway.metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        gateway.metrics.errors.labels("400").inc()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        gateway.metrics.errors.labels(str(exc.status_code)).inc()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # Starlette puts `Allow` on its 405s: keep the exception's headers.
        return ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        gateway.metrics.errors.labels("500").inc()
        return ApiError(500, "Internal server error", "server_error", code="internal_error").response()

    for module in (routes_completions, routes_chat, responses_api, routes_embeddings, routes_scoring, routes_models,
                   routes_metrics, routes_tokenize):
        app.include_router(module.router)
    if gateway.config.runtime_lora:
        from kvrelay.gateway import routes_lora

        app.include_router(routes_lora.router)
    app.add_middleware(BodyLimit, max_bytes=gateway.config.max_body_bytes)
    app.add_middleware(CloseWhileDraining, draining=lambda: gateway.draining)
    app.add_middleware(HeaderCountLimit, max_headers=gateway.config.frontdoor.max_headers)
    app.add_middleware(AccessLog)  # added last but CORS: outermost, so it sees every status, 413 and 431 included
    if gateway.config.allowed_origins:  # browsers then read every answer, errors included
        app.add_middleware(CORSMiddleware, allow_origins=gateway.config.allowed_origins,
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["x-request-id", "retry-after", *(
                               f"x-ratelimit-{k}-{w}" for k in ("limit", "remaining", "reset")
                               for w in ("requests", "tokens"))])
    return app
