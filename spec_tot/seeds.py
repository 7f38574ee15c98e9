"""Every seed rule in one place.

- A request's sampling seed is a pure function of the config's base seed, the query's *seed
  key* and the request's path below the query's root (``request_seed``, ``seed_below``).
  The seed key is the user's ``query_id`` when given, else the input itself (its canonical
  JSON), never an auto-assigned ``q<n>`` id: the same question asked twice of one app gets
  the same answer, and a node's sample never depends on scheduling or executor mode. Another
  runtime that wants the executor's samples (a LangGraph run of the same graph) uses
  ``request_seed``.
- A request's n samples are independent streams: sample ``i`` draws from ``seed_mix(seed,
  i)``; a backend that splits them into n one-sample requests seeds them ``sample_seed(seed,
  i)`` (sample 0 keeps the request's seed).
"""

from __future__ import annotations

import hashlib
import json

from spec_tot.graph_nodes import State

__all__ = [
    "query_seed",
    "request_seed",
    "sample_seed",
    "seed_below",
    "seed_key",
    "seed_mix",
    "stable_seed",
]


def stable_seed(base: int, key: str) -> int:
    """A seed that depends only on ``base`` and ``key`` (never on Python's hash salt), so a
    node's sample is the same in every run and every executor mode."""
    digest = hashlib.blake2b(f"{base}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def seed_key(state: State, explicit_id: str | None) -> str:
    """The user's query id when given, else the input's canonical JSON (values JSON cannot
    hold are written with ``str``)."""
    if explicit_id is not None:
        return f"id:{explicit_id}"
    content = {k: v for k, v in state.items() if k != "query_id"}
    return "input:" + json.dumps(content, sort_keys=True, default=str)


def query_seed(base_seed: int, key: str) -> int:
    return stable_seed(base_seed, key)


def request_seed(base_seed: int, query_id: str, request_id: str, key: str | None = None) -> int:
    """The seed of ``request_id`` (``query_id/...``) in a query whose seed key is ``key``
    (default: the explicit ``query_id``)."""
    if not request_id.startswith(query_id):
        raise ValueError(f"request {request_id!r} is not under query {query_id!r}")
    qseed = query_seed(base_seed, key if key is not None else f"id:{query_id}")
    return seed_below(qseed, query_id, request_id)


def seed_below(qseed: int, query_id: str, request_id: str) -> int:
    """The seed of ``request_id`` in the query ``query_id`` whose seed is ``qseed``: from
    the request's path below the root, never the query id itself (which may be
    auto-assigned). The one rule both the executor and ``request_seed`` use."""
    return stable_seed(qseed, request_id[len(query_id) :])


_MASK63 = (1 << 63) - 1


def seed_mix(seed: int, index: int) -> int:
    """The fixed mix of a request's seed and a sample's index: what seeds sample ``index``'s
    own random stream, independent of batching. Within a signed 64-bit int (SGLang's
    ``sampling_seed`` range)."""
    return ((seed & _MASK63) * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK63


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` when a request's n samples travel as n one-sample requests:
    sample 0 keeps the request's seed (so n = 1 is the request itself), the others get
    ``seed_mix``."""
    return seed if index == 0 else seed_mix(seed, index)
