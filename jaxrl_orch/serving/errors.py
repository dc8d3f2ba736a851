"""Errors as the HTTP contract writes them: OpenAI's ``{"error": {...}}`` body with a status.

``ApiError(status, message, param=..., type=...)`` is raised anywhere in a route; the app's
handler turns it (and pydantic's validation errors, and malformed JSON) into the body below, so
every 4xx names the bad value and what is allowed, and the server keeps serving:
``{"error": {"message", "type", "param", "code"}, "object": "error"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), self.status, headers)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {
        "object": "error",
        "error": {"message": message, "type": kind, "param": param, "code": status},
    }
