"""Cross-origin protection for a local server: a web page must not drive it.

A browser lets any page send a "simple" cross-origin request (a POST with ``text/plain``,
form data, or no body) without asking first, and a local ``spec-tot serve`` without a key
would run it. Two rules close that, before auth and routing:

- a request with an ``Origin`` header (browsers send one on every cross-origin request and
  on every POST) is refused with a 403 unless that origin is in the allow-list (default:
  none); an allowed origin's preflight (``OPTIONS``) is answered as CORS expects and its
  responses carry ``Access-Control-Allow-Origin``;
- a request with a body to a JSON route must say ``Content-Type: application/json`` (a 415
  otherwise): a page can only send that type after a preflight, which the first rule
  refuses.

Clients that are not browsers (curl, SDKs, the project's own backends) send no ``Origin``
and JSON, and see no difference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spec_tot.errors import ConfigError

__all__ = ["CrossOriginGuard", "check_origins"]

# Routes whose POST carries no JSON body (SGLang's /flush_cache is posted empty).
_BODYLESS = frozenset({"/flush_cache"})
_METHODS = b"GET, POST, PUT, OPTIONS"
_HEADERS = b"authorization, content-type"


def check_origins(origins: Sequence[str], field: str = "allow_origin") -> tuple[str, ...]:
    """Origins as browsers send them (``scheme://host[:port]``, no path); a ``ConfigError``
    naming ``field`` for anything else (``*`` included: a wildcard would undo the guard)."""
    out = []
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
            raise ConfigError(field, f"{origin!r} is not an origin like 'https://host:port'")
        out.append(origin)
    return tuple(out)


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class CrossOriginGuard:
    """Pure ASGI (as ``BearerAuth``): a refused request never reaches auth or a route."""

    def __init__(self, app: ASGIApp, allowed_origins: Sequence[str] = ()) -> None:
        self.app = app
        self.allowed = frozenset(check_origins(allowed_origins))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin_raw = headers.get(b"origin")
        origin = origin_raw.decode("latin-1") if origin_raw is not None else None
        if origin is not None and origin not in self.allowed:
            allowed = sorted(self.allowed) or "none"
            why = f"cross-origin request from {origin!r} refused (allowed: {allowed}; "
            await _refuse(send, 403, why + "spec-tot serve --allow-origin)")
            return
        method = scope["method"]
        if origin is not None and method == "OPTIONS":  # an allowed origin's preflight
            reply = [
                (b"access-control-allow-origin", origin_raw),
                (b"access-control-allow-methods", _METHODS),
                (b"access-control-allow-headers", _HEADERS),
                (b"vary", b"origin"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": reply})
            await send({"type": "http.response.body", "body": b""})
            return
        if method in ("POST", "PUT") and scope["path"] not in _BODYLESS:
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1") or "none"
                await _refuse(send, 415, f"Content-Type must be application/json, got {shown}")
                return
        if origin is None:
            await self.app(scope, receive, send)
            return

        async def send_with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"access-control-allow-origin", origin_raw), (b"vary", b"origin")]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_origin)
