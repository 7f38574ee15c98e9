"""``--api-key``: SGLang's Bearer convention (``srt/utils/auth.py``). With a key, every route
asks for ``Authorization: Bearer <key>`` (compared in constant time), ``/abort_request`` and
``abort_all`` included, and the health probes too: SGLang leaves ``/health*`` and
``/metrics`` open for load balancers, but an open ``/health_generate`` runs the engine for
anyone who reaches the port, so here a probe sends the key like any other client (the HTTP
adapters do: ``HttpConfig.api_key``)."""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["BearerAuth"]


class BearerAuth:
    """Pure ASGI (not ``BaseHTTPMiddleware``), so a route still sees its client disconnect."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

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
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )
