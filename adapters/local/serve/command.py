"""``spec-tot serve``: the embedded engine over SGLang's native HTTP API (and OpenAI's).

Registered with the core CLI through the ``spec_tot.commands`` entry point group (see
``spec_tot.cli.kit``): the core knows nothing of the server. Every option is checked (auth,
limits, the port tried) before the engine loads.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from spec_tot.cli import kit as cli_kit
from spec_tot.cli.kit import (
    BackendParamOpt,
    ProgramOpt,
    as_option,
    load_program,
    parse_backend_options,
    parse_pairs,
    schema_of,
    typed_pairs,
)
from spec_tot.errors import ConfigError

from .limits import ServeLimits

__all__ = [
    "API_KEY_ENV",
    "api_key_from",
    "build_server",
    "check_bind",
    "is_loopback",
    "parse_serve_limits",
    "serve",
]

API_KEY_ENV = "SPEC_TOT_API_KEY"


def api_key_from(given: str | None) -> tuple[str | None, str]:
    """The API key and where it came from: ``--api-key``, else ``$SPEC_TOT_API_KEY`` when
    the variable is set at all (set and empty is an error, never auth turned off)."""
    if given is not None:
        return given, "--api-key"
    if API_KEY_ENV in os.environ:
        return os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    return None, "--api-key"


def build_server(
    program: str | None,
    backend_opt: Sequence[str] | None,
    api_key: str | None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    limits: Sequence[str] | None = None,
    insecure_no_auth: bool = False,
    key_source: str = "--api-key",
    allow_origin: Sequence[str] | None = None,
) -> Any:
    """The ``serve`` app: every option checked (auth, limits, the port tried) before the
    engine loads. Without a key a non-loopback ``host`` is refused unless
    ``insecure_no_auth``."""
    from .app import create_server_app  # the server's imports, only when it is built
    from .auth import check_api_key
    from .origin import check_origins

    origins = check_origins(allow_origin or (), "--allow-origin")
    with as_option("--program"):
        prog = load_program(program or "game24")
    given = parse_backend_options(backend_opt, "local")
    serve_limits = parse_serve_limits(limits)
    if api_key is not None:
        check_api_key(api_key, key_source)
        if insecure_no_auth:
            raise ConfigError(
                "--insecure-no-auth", f"given with an API key ({key_source}): choose one"
            )
    elif not insecure_no_auth and not is_loopback(host):
        raise ConfigError(
            "--host",
            f"{host} is reachable from other machines and no API key is set: give --api-key "
            f"(or ${API_KEY_ENV}), or --insecure-no-auth to serve without authentication",
        )
    if port is not None:
        check_bind(host, port)
    # the server's own process only moves HTTP: the engine may take every core
    options = {"caller_core": False, **prog.backend_options("local"), **given}
    pairs = " ".join(f"{k}={v}" for k, v in given.items())
    backend = cli_kit.start_backend(
        "local", options, f"--backend-opt {pairs}" if pairs else "defaults", tuple(given)
    )
    return create_server_app(
        backend,
        model_path=str(options.get("policy_path", "")),
        api_key=api_key,
        limits=serve_limits,
        allowed_origins=origins,
    )


def serve(
    program: ProgramOpt = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to bind.")] = 30000,
    backend_opt: BackendParamOpt = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' on every route (as SGLang's --api-key); "
            f"default: ${API_KEY_ENV} when set. An empty or padded key is refused.",
            show_default=False,
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(help="Serve a non-loopback --host without an API key (anyone can use it)."),
    ] = False,
    limit: Annotated[
        list[str] | None,
        typer.Option(
            help="Server limit NAME=VALUE (ServeLimits: max_samples_per_request, "
            "max_inflight_samples, max_connections, header_timeout_s, stream_stall_s, ...)."
        ),
    ] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="A web origin (https://host:port) whose pages may call this server; "
            "repeatable. Default: none (a request with an Origin header is a 403)."
        ),
    ] = None,
) -> None:
    """Serve the embedded engine (and the program's PRM) over SGLang's native HTTP API."""
    from .connections import GuardedServer, server_config

    key, source = api_key_from(api_key)
    server = build_server(
        program,
        backend_opt,
        key,
        host=host,
        port=port,
        limits=limit,
        insecure_no_auth=insecure_no_auth,
        key_source=source,
        allow_origin=allow_origin,
    )
    config = server_config(server, host=host, port=port)
    listening = _announce(host, port, key, source, server.state.connections.cap)

    class Announcing(GuardedServer):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)  # the engine is up and the socket accepts
            if not self.should_exit:
                listening()

    Announcing(config).run()


def _announce(host: str, port: int, key: str | None, source: str, cap: int) -> Callable[[], None]:
    """Say now what is starting (a warning first when anyone can use it); the call it
    returns says where it listens, once it accepts connections."""
    if key is None and not is_loopback(host):
        _say(
            f"warning: serving on {host} with no API key (--insecure-no-auth): anyone who "
            "reaches the port can generate and abort requests"
        )
    _say(
        f"spec-tot serve: starting the engine for http://{host}:{port} (model load; on a "
        "model's first start on this machine, a step-time calibration of a minute or more); "
        "the URL is printed again once it accepts connections"
    )
    auth = f"Bearer key from {source}" if key is not None else "no auth"
    line = (
        f"spec-tot serve: listening on http://{host}:{port} (SGLang native API and OpenAI's "
        f"/v1; {auth}; at most {cap} connections)"
    )
    return lambda: _say(line)


def _say(line: str) -> None:
    """One line on stderr (stdout is left to the results of other commands)."""
    cli_kit.console.print(line, soft_wrap=True, markup=False, highlight=False)


def parse_serve_limits(pairs: Sequence[str] | None) -> ServeLimits:
    """``--limit NAME=VALUE`` pairs as a checked ``ServeLimits`` (its connection cap checked
    against the open-file limit too); errors name ``--limit NAME``."""
    typed = typed_pairs(parse_pairs(pairs, "--limit"), schema_of(ServeLimits), "--limit")
    try:
        limits = ServeLimits(**typed)
        limits.connection_plan()
    except ConfigError as exc:
        message = str(exc).removeprefix(f"{exc.field}: ")
        raise ConfigError(f"--limit {exc.field}", message) from None
    return limits


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches only this machine (every address it resolves to)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, port: int) -> None:
    """Fail now, before the engine loads, if ``host:port`` cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise ConfigError("--host", f"cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError("--port", f"cannot bind {host}:{port}: {exc.strerror}") from None
