"""What the live tests share: the scripts that fetch SmolLM2 and run vLLM on CPU
(``scripts/fetch_smollm2.py``, ``scripts/vllm_cpu.py``), importable by name once this is
imported, the vLLM venv to use, and the model as a fixture."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import fetch_smollm2  # noqa: E402 - scripts/, on the path now
import vllm_cpu  # noqa: E402

__all__ = ["SCRIPTS", "fetch_smollm2", "smollm2", "vllm_cpu", "vllm_venv"]


def vllm_venv() -> Path | None:
    """``$SPEC_TOT_VLLM_VENV`` (an installed vllm-cpu venv), else the script's default."""
    given = os.environ.get("SPEC_TOT_VLLM_VENV")
    return Path(given) if given else None


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(fetch_smollm2.fetch_smollm2())
