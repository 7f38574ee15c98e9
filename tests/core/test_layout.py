"""Where things live, checked: the command line is one package, tests and benchmarks import
installed code only (no ``sys.path`` edits), and a test file's helpers come from the tests'
top folder or its own, so every test file passes when run alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def test_the_command_line_is_one_package() -> None:
    root = REPO / "spec_tot"
    assert not [p.name for p in root.glob("*.py") if "cli" in p.name]
    assert (root / "cli" / "__init__.py").is_file()


def test_no_test_or_benchmark_edits_sys_path() -> None:
    edits = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("tests", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append)|sys\.path\s*\[", line)
    ]
    assert not edits, edits


def test_a_test_file_imports_helpers_from_the_top_or_its_own_folder() -> None:
    shared = {p.stem for p in TESTS.glob("*.py")}
    crossing = []
    for path in sorted(TESTS.rglob("*.py")):
        own = {p.stem for p in path.parent.glob("*.py")}
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            for name in names:
                local = {p.stem for p in TESTS.rglob(f"{name}.py")}
                if local and name not in shared and name not in own:
                    crossing.append(f"{path.relative_to(REPO)}: {name}")
    assert not crossing, crossing
