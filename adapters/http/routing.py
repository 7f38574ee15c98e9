"""Sticky routing: every request of one query goes to the same worker, where its prefix
(radix) cache lives; the query's home moves only when that worker cannot take it."""

from __future__ import annotations

from collections import Counter, OrderedDict

from spec_tot.errors import BackendError

from .endpoint import Endpoint

__all__ = ["StickyRoutes", "query_key"]


def query_key(request_id: str) -> str:
    """The routing key of a hierarchical id ``query/node/...``: its first segment."""
    return request_id.split("/", 1)[0]


class StickyRoutes:
    """Query key -> home worker, an LRU of ``size`` homes over the pool's ``endpoints``
    (in ``urls`` order)."""

    def __init__(self, urls: list[str], endpoints: dict[str, Endpoint], size: int) -> None:
        self.urls = urls
        self.endpoints = endpoints
        self.size = size
        self._home: OrderedDict[str, str] = OrderedDict()
        self._homed: Counter[str] = Counter()

    def candidates(self, key: str | None) -> list[Endpoint]:
        """Workers to try, best first: the key's home if healthy, then the least loaded."""
        healthy = [e for e in self.endpoints.values() if e.available()]
        # New queries go to the least busy worker, then the one homing fewest queries.
        healthy.sort(key=lambda e: (e.inflight, self._homed[e.url], self.urls.index(e.url)))
        home = self._home.get(key) if key is not None else None
        if home is not None:
            self._home.move_to_end(key)  # type: ignore[arg-type]
            first = [e for e in healthy if e.url == home]
            healthy = first + [e for e in healthy if e.url != home]
        return healthy

    def pick(
        self, key: str | None, only: str | None, missed: set[str], errors: list[str]
    ) -> Endpoint | None:
        """The worker for a request's next attempt (``only``: that one, no failover), not
        one that may still run it (``missed``), its send right claimed and counted, and made
        the key's home now, so a query's concurrent requests follow it; None, the reason
        added to ``errors``, when none may be tried now."""
        if only is not None:
            pinned = self.endpoints.get(only.rstrip("/"))
            if pinned is None:
                raise BackendError(only, "not a configured endpoint")
            pool = [pinned] if pinned.available() else []
        else:
            pool = self.candidates(key)
        endpoint = next((e for e in pool if e.url not in missed and e.claim()), None)
        if endpoint is None:
            targets = [only.rstrip("/")] if only else self.urls
            seen = [r for u in targets if (r := self.endpoints[u].stopped_reason)]
            why = f" ({seen[0]})" if seen else ""
            errors.append(f"{only or ', '.join(self.urls)}: circuit open{why}")
            return None
        endpoint.count_attempt()
        self.settle(key, endpoint.url)
        return endpoint

    def home_of(self, key: str) -> str | None:
        return self._home.get(key)

    def settle(self, key: str | None, url: str) -> None:
        """Make ``url`` the home of ``key`` (the most recently used one)."""
        if key is None:
            return
        old = self._home.get(key)
        if old != url:
            if old is not None:
                self._homed[old] -= 1
            self._homed[url] += 1
        self._home[key] = url
        self._home.move_to_end(key)
        while len(self._home) > self.size:
            self._homed[self._home.popitem(last=False)[1]] -= 1

    def forget(self, key: str) -> None:
        old = self._home.pop(key, None)
        if old is not None:
            self._homed[old] -= 1
