"""The house's size rules, so a newcomer can read any part in one sitting: no file over 400
lines, no class over 250, no function over 60, in ``spec_tot/`` and ``adapters/``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"file": 400, "class": 250, "function": 60}


def oversized(root: Path, base: Path = ROOT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(base)
        if source.count("\n") > LIMITS["file"]:
            out.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            kind = (
                "class"
                if isinstance(node, ast.ClassDef)
                else "function"
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                else None
            )
            if kind is not None:
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LIMITS[kind]:
                    out.append(f"{name}:{node.lineno} {kind} {node.name}: {lines} lines")
    return out


def test_no_file_class_or_function_past_the_limits() -> None:
    assert [*oversized(ROOT / "spec_tot"), *oversized(ROOT / "adapters")] == []


def test_the_check_finds_an_oversized_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "big.py").write_text(f"def big() -> None:\n{body}\n")
    assert oversized(tmp_path, tmp_path) == ["big.py:1 function big: 62 lines"]
