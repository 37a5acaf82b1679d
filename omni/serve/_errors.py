"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}``.

Clients written for OpenAI (its official SDK among them) read `message` and map the status
to an exception class (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 413,
429 RateLimitError, 5xx InternalServerError); the same shape comes back for every failure.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

__all__ = ["ApiError", "api_error_handler", "error_body", "error_response"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_unavailable"}


class ApiError(Exception):
    """A request the server answers with an error status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON object of an error response."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    """`error` as a response."""
    return JSONResponse(error_body(error.status, error.message, param=error.param,
                                   code=error.code), status_code=error.status,
                        headers=error.headers)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's handler for `ApiError`."""
    assert isinstance(exc, ApiError)
    return error_response(exc)
