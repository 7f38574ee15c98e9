"""``--api-key``: SGLang's Bearer convention (``srt/utils/auth.py``). With a key, every route
asks for ``Authorization: Bearer <key>``, ``/abort_request`` and ``abort_all`` included, and
the health probes too: SGLang leaves ``/health*`` and ``/metrics`` open for load balancers,
but an open ``/health_generate`` runs the engine for anyone who reaches the port, so here a
probe sends the key like any other client (the HTTP adapters do: ``HttpConfig.api_key``).

The key rule (``check_api_key``, used by the app and by the CLI for ``--api-key`` and
``$SPEC_TOT_API_KEY`` alike): a key is a non-empty string without surrounding whitespace
(HTTP strips it from a header value, so such a key could never match) that encodes as
UTF-8. The header is compared as UTF-8 bytes in constant time (``hmac.compare_digest``), so
a non-ASCII key matches the bytes a client sends for it.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from spec_tot.errors import ConfigError

__all__ = ["BearerAuth", "check_api_key"]


def check_api_key(key: object, field: str) -> bytes:
    """The key's bytes; a ``ConfigError`` naming ``field`` for a key that is empty, only
    whitespace, padded with whitespace, or not sendable as an HTTP header value (visible
    ASCII, no whitespace inside either)."""
    if not isinstance(key, str):
        raise ConfigError(field, f"must be a string, got {type(key).__name__}")
    if not key.strip():
        raise ConfigError(field, "must not be empty or whitespace (that would turn auth off)")
    if key != key.strip():
        raise ConfigError(field, "has leading or trailing whitespace, which no client can send")
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        # an HTTP header value: a newline, space, control or non-ASCII character in it
        # cannot be sent (or is sent mangled), and every request would then be a 401
        raise ConfigError(
            field, f"must be visible ASCII with no whitespace (an HTTP header value), has {bad!r}"
        )
    return key.encode("ascii")


class BearerAuth:
    """Pure ASGI (not ``BaseHTTPMiddleware``), so a route still sees its client disconnect."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = check_api_key(api_key, "api_key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "Unauthorized: send the API key as 'Authorization: Bearer <key>'",
                    "type": "authentication_error",
                    "param": "Authorization",
                    "code": 401,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest on bytes takes time independent of where they differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
