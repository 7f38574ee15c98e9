"""``create_server_app``: the ASGI app of ``spec-tot serve`` (routes, errors, auth, origins)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spec_tot.errors import ConfigError

from ..backend import LocalBackend
from .auth import BearerAuth, check_api_key
from .context import ServeContext
from .limits import ServeLimits
from .native import internal_error, native_routes
from .openai import openai_routes
from .origin import CrossOriginGuard, check_origins
from .outputs import error_body

__all__ = ["create_server_app"]


def create_server_app(
    backend: LocalBackend,
    *,
    model_path: str = "",
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    allowed_origins: Sequence[str] = (),
) -> Starlette:
    """The ASGI app. ``served_model_name`` (default: the model folder's name) is the model id
    of the OpenAI routes; ``api_key`` turns on Bearer authentication (``check_api_key``'s
    rule: an empty or padded key is a ``ConfigError``, never auth turned off); ``limits``:
    the server's limits (default ``ServeLimits()``); ``allowed_origins``: the web origins
    whose pages may call it (default none: ``origin.py``)."""
    if api_key is not None:
        check_api_key(api_key, "api_key")
    origins = check_origins(allowed_origins, "allowed_origins")
    if limits is not None and not isinstance(limits, ServeLimits):
        raise ConfigError("limits", f"must be a ServeLimits, got {type(limits).__name__}")
    name = served_model_name or (Path(model_path).name if model_path else "default")
    ctx = ServeContext(backend, model_path, name, limits)

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(
            error_body(str(exc.detail), None, exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def internal(_request: Request, exc: Exception) -> Response:
        # A fault outside the guarded routes (body errors, 413 included, are answered there).
        return internal_error(exc)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await backend.start()  # the engine is up before the first request is accepted
        ctx.limits  # noqa: B018 - read now, so no request pays for it
        yield

    app = Starlette(
        lifespan=lifespan,
        routes=[*native_routes(ctx), *openai_routes(ctx)],
        exception_handlers={
            HTTPException: http_error,
            Exception: internal,
        },
    )
    app.state.serve = ctx
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    # added last, so outermost: a page's request is refused before auth or any route
    app.add_middleware(CrossOriginGuard, allowed_origins=origins)
    return app
