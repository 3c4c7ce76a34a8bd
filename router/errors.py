"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from aiohttp import web

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status (any other 4xx is an ``invalid_request_error``)."""
    return TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


class ApiError(Exception):
    """Raised anywhere in a handler; the middleware turns it into the OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": error_type(self.status), "param": self.param, "code": self.code}
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)
