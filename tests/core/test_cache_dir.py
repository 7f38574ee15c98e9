"""``spec_tot.cache_dir.cache_root`` is the one home of spec-tot's cache folder: the model
``scripts/fetch_smollm2.py`` writes is where the math program looks, under
``$XDG_CACHE_HOME`` as much as under ``$SPEC_TOT_CACHE_DIR``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spec_tot.cache_dir import cache_root
from spec_tot.errors import ConfigError
from spec_tot.graphs import math as math_program
from spec_tot.peers import smollm2, vllm_cpu

REPO = Path(__file__).resolve().parents[2]
_NAMES = r"[\"'](?:SPEC_TOT_CACHE_DIR|XDG_CACHE_HOME)[\"']"
# a read (``environ.get(...)``, ``getenv(...)``, ``environ[...]`` not assigned), not a child's
# environment being set
_READ = re.compile(rf"(?:environ\.get|getenv)\(\s*{_NAMES}|environ\[{_NAMES}\](?!\s*=)")


@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "SPEC_TOT_CACHE_DIR"])
def test_every_cached_thing_lives_under_the_one_root(
    variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPEC_TOT_CACHE_DIR", raising=False)
    monkeypatch.setenv(variable, str(tmp_path))
    root = cache_root()
    assert root == (tmp_path / "spec-tot" if variable == "XDG_CACHE_HOME" else tmp_path)
    assert smollm2.smollm2_folder() == root / "models" / "SmolLM2-135M-Instruct"
    assert math_program.smollm2_folder() == smollm2.smollm2_folder()
    assert vllm_cpu.venv_dir().parent == root
    # the math program looks exactly where the fetch writes, and says so when it is missing
    with pytest.raises(ConfigError, match=re.escape(str(smollm2.smollm2_folder()))):
        math_program.PROGRAM.backend_options("local")


def test_no_other_module_reads_the_cache_variables() -> None:
    readers = []
    for folder in ("spec_tot", "adapters", "graphs", "scripts", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "cache_dir.py":
                continue
            text = path.read_text()
            if _READ.search(text):
                readers.append(str(path.relative_to(REPO)))
    assert not readers, readers
