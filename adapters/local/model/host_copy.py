"""Host lists to device tensors without a host synchronisation.

``torch.tensor(data, device="cuda")`` copies from pageable memory, and torch then waits for
the whole stream (``cudaStreamSynchronize``) so the source can be freed: one host stall per
small tensor. Measured on an H200 before this seam: 4.7 stream synchronisations per engine
step, each waiting for every kernel queued before it. Staged through pinned memory (torch's
caching host allocator keeps the block until the copy has run) the copy is queued and the
host moves on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["to_device"]


def to_device(
    data: Sequence[Any] | float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``data`` as a ``dtype`` tensor on ``device`` (on CUDA: a non-blocking copy)."""
    host = torch.tensor(data, dtype=dtype)
    # (a string or a torch.device; no torch.device built per call: this is on every step)
    kind = device if isinstance(device, str) else device.type
    if kind.startswith("cuda"):
        return host.pin_memory().to(device, non_blocking=True)
    return host
