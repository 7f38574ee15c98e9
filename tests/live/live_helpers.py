"""What the live tests share: what fetches SmolLM2 and runs vLLM on CPU
(``spec_tot.peers``), the vLLM venv to use, and the model as a fixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spec_tot.peers import smollm2 as fetch_smollm2
from spec_tot.peers import vllm_cpu

__all__ = ["fetch_smollm2", "smollm2", "vllm_cpu", "vllm_venv"]


def vllm_venv() -> Path | None:
    """``$SPEC_TOT_VLLM_VENV`` (an installed vllm-cpu venv), else the script's default."""
    given = os.environ.get("SPEC_TOT_VLLM_VENV")
    return Path(given) if given else None


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(fetch_smollm2.fetch_smollm2())
