"""The live tests' fixtures (``live_helpers.py``)."""

from live_helpers import smollm2

__all__ = ["smollm2"]
