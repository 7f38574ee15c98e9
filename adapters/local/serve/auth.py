"""``--api-key``: SGLang's Bearer convention (``srt/utils/auth.py``). With a key, every route
asks for ``Authorization: Bearer <key>`` (compared in constant time), ``/abort_request`` and
``abort_all`` included; without it the answer is a 401. Only the liveness probes ``/health``
and ``/health_generate`` stay open, as SGLang keeps them for load balancers and Kubernetes
(they run nothing and tell nothing but "up")."""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["BearerAuth"]

_OPEN = ("/health", "/health_generate")


class BearerAuth:
    """Pure ASGI (not ``BaseHTTPMiddleware``), so a route still sees its client disconnect."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN or self._allowed(scope):
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
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )
