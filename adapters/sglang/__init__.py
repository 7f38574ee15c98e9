"""SGLang backend: an HTTP client of SGLang's native API (no ``import sglang``).

``backend`` holds the backend and what it relies on in SGLang's protocol; ``protocol``
reads its replies (and the token budget of its requests, for the shared pool's deadlines);
``wire`` builds and sends one wire request; ``groups`` merges identical requests into one;
``rewards`` scores over ``/classify`` or a generative judge. Its load (``/v1/loads``) is read
by the shared pool's queue reader (``adapters/http/queues.py``).
"""

from __future__ import annotations

from .backend import SGLangBackend, create_sglang
from .config import SGLangConfig
from .protocol import SGLANG_WIRE

__all__ = ["SGLANG_WIRE", "SGLangBackend", "SGLangConfig", "create_sglang"]
