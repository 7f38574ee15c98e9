"""``spec-tot serve``: the embedded engine behind SGLang's native HTTP API and the
OpenAI-compatible API on one port, so SGLang's own frontend, the openai SDK, LangChain's
ChatOpenAI and spec-tot's SGLang and OpenAI adapters all run against it.

Native routes (``native.py``; SGLang 0.5.23 ``http_server.py``): ``/generate`` (single or
batched, n > 1, streaming, POST and PUT), ``/abort_request``, ``/health``,
``/health_generate``, ``/model_info`` (and ``/get_model_info``), ``/server_info`` (and
``/get_server_info``, with KV and running/waiting counts), ``/flush_cache``, ``/v1/loads``,
``/metrics`` and ``/classify`` (the PRM). OpenAI routes (``openai.py``): ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``.

Every client error is a 4xx whose message names the field; an unimplemented parameter is a
400 naming it; with ``api_key`` every route, the health probes included, needs
``Authorization: Bearer <key>`` (``auth.py``). Every request, connection and stream has a
limit (``ServeLimits``, ``limits.py``): past a per-request one a 4xx naming it, past a
server-wide in-flight one a 429 with ``Retry-After``. Serve the app with
``GuardedServer(server_config(app, host=..., port=...))`` (``connections.py``): uvicorn's own
settings leave half-open connections open forever, and its accept loop meets ``EMFILE``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GenerateBatch",
    "GuardedServer",
    "Limits",
    "ServeLimits",
    "check_api_key",
    "create_server_app",
    "parse_generate",
    "server_config",
]

# Lazy re-exports: the CLI registers ``serve`` (``command.py``) without loading the server.
_MODULES = {
    "schema": ("GenerateBatch", "Limits", "parse_generate"),
    "connections": ("GuardedServer", "server_config"),
    "limits": ("ServeLimits",),
    "auth": ("check_api_key",),
    "app": ("create_server_app",),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
