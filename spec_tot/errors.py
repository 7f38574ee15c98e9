"""Every exception spec-tot raises on purpose.

Bad input is a ``ValueError`` (so ``except ValueError`` keeps working for callers who do not
know this module); runtime failures of a backend or a query are ``RuntimeError``s::

    SpecTotError
    ├── ConfigError(ValueError)          a bad field in a config / request / sampling value
    │   └── GraphValidationError         a ThoughtGraph that cannot compile; names the node
    ├── UnknownNameError(ValueError)     a policy / backend / mode name not in its registry
    └── ExecutionError(RuntimeError)     a query could not finish
        ├── BackendError                 a backend failed after its bounded retries
        │   └── BackendTimeoutError      no answer within the deadline
        └── QueryTimeoutError            the query exceeded its own deadline

Errors carry the offending name in ``field`` / ``node`` / ``endpoint`` so tools can show it.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendTimeoutError",
    "ConfigError",
    "ExecutionError",
    "GraphValidationError",
    "IllegalTransition",
    "QueryTimeoutError",
    "SpecTotError",
    "UnknownNameError",
]


class SpecTotError(Exception):
    """Base of every spec-tot exception."""


class ConfigError(SpecTotError, ValueError):
    """A configuration or request field holds a value it cannot take."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class GraphValidationError(ConfigError):
    """A ThoughtGraph failed validation at compile time."""

    def __init__(self, node: str, message: str) -> None:
        self.node = node
        super().__init__(f"node {node!r}", message)


class UnknownNameError(SpecTotError, ValueError):
    """A name looked up in a registry (policy, backend, mode) does not exist."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(sorted(known))}")


class ExecutionError(SpecTotError, RuntimeError):
    """A query could not run to completion."""


class IllegalTransition(ExecutionError):
    """The executor asked a search tree for a move its node's state does not allow (a bug
    in the executor, never in the user's input): the message names the node and the move."""

    def __init__(self, node_id: str, move: str, status: str) -> None:
        self.node_id = node_id
        super().__init__(f"node {node_id!r}: cannot {move} a {status} node")


class BackendError(ExecutionError):
    """A backend failed (after its retries). ``endpoint`` names it."""

    def __init__(self, endpoint: str, message: str) -> None:
        self.endpoint = endpoint
        super().__init__(f"{endpoint}: {message}")


class BackendTimeoutError(BackendError):
    """A backend gave no answer within its deadline."""


class QueryTimeoutError(ExecutionError):
    """The query ran past its deadline."""
