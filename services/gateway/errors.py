"""OpenAI-style error objects and the exceptions the gateway raises to produce them.

Every failure a client can cause maps to one `ApiError` with an HTTP status and a body
`{"error": {"message", "type", "param", "code"}}` as OpenAI's API returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi.responses import JSONResponse


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, param: str | None = None) -> ApiError:
    return ApiError(403, message, "permission_error", param, "model_not_allowed")


def model_not_found(model: str, available: list[str]) -> ApiError:
    return ApiError(404, f"The model {model!r} does not exist; available: {', '.join(available)}",
                    "invalid_request_error", "model", "model_not_found")


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, "invalid_request_error", param, "request_too_large")


def rate_limited(message: str, code: str, headers: dict[str, str]) -> ApiError:
    return ApiError(429, message, "rate_limit_error", None, code, headers=headers)


def unavailable(message: str, code: str = "service_unavailable", retry_after: int | None = 1) -> ApiError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return ApiError(503, message, "service_unavailable_error", None, code, headers=headers)


def check_text(text: str, field_name: str) -> None:
    """A 400 for text that is not valid Unicode (a lone surrogate), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{field_name}: contains invalid Unicode (a lone surrogate at {e.start})",
                          field_name) from e
