"""Bearer-token access control: API keys on the public app, one admin token on the admin app.

Tokens are compared in constant time: both sides are hashed to a fixed length first (so the
comparison does not reveal a key's length) and every configured key is compared (so the time does
not reveal which one matched). Health probes stay open so orchestrators need no secret.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable

from aiohttp import web

from router.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready"})


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def bearer_token(request: web.Request) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or ``""``."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def token_matches(token: str, secrets: Iterable[str]) -> bool:
    """True when ``token`` equals one of ``secrets``; constant time in the token and the match."""
    given = _digest(token)
    found = False
    for secret in secrets:
        found |= hmac.compare_digest(given, _digest(secret))
    return found and bool(token)


class Unauthorized(ApiError):
    def __init__(self, what: str):
        super().__init__(
            401,
            f"invalid or missing {what} (send 'Authorization: Bearer <{what}>')",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="llamadeploy"'},
        )


def auth_middleware(
    secrets_of: Callable[[web.Request], list[str]],
    what: str = "API key",
    is_open: Callable[[str], bool] = OPEN_PATHS.__contains__,
):
    """Require a bearer token from ``secrets_of(request)`` when that list is non-empty, on every
    path but those ``is_open`` accepts (default: the health probes)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        secrets = secrets_of(request)
        if secrets and not is_open(request.path) and not token_matches(bearer_token(request), secrets):
            raise Unauthorized(what)
        return await handler(request)

    return middleware
