"""Machinery behind the public API; no stability promise."""

__all__: list[str] = []
