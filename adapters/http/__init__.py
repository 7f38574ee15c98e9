"""The HTTP client every serving backend shares: a pool of workers with sticky routing,
bounded retries, circuit breakers and per-request deadlines (``EndpointPool``), its settings
(``HttpConfig``), and the seam a backend plugs its protocol into (``WireProtocol``).

A new HTTP backend builds an ``EndpointPool`` with its own ``WireProtocol`` (how many output
tokens a request body asks for, how many a reply holds) and sends through ``call`` (the
one retry layer: a reply consumed under its deadline, a cut one resent where safe),
``send`` or ``json``;
nothing here knows any server's request or reply shapes.
"""

from __future__ import annotations

from .breaker import CircuitBreaker
from .config import HttpConfig, split_http_options
from .endpoint import Endpoint
from .pool import RETRYABLE_STATUS, EndpointPool
from .protocol import WireProtocol, positive_int
from .routing import query_key
from .sse import sse_events

__all__ = [
    "RETRYABLE_STATUS",
    "CircuitBreaker",
    "Endpoint",
    "EndpointPool",
    "HttpConfig",
    "WireProtocol",
    "positive_int",
    "query_key",
    "split_http_options",
    "sse_events",
]
