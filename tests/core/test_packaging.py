"""The wheel holds every package: pyproject lists packages by hand (``graphs/`` and
``adapters/`` install only as ``spec_tot.*``), so a new subpackage missing from the list
would work in an editable install and break in a real one."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = {package: Path(folder) for package, folder in tool["package-dir"].items()}
    found: set[str] = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *rel.parts])
            # A nested mapped folder (spec_tot.graphs under spec_tot/) is found once, by its
            # own mapping.
            if not any(
                other != package and name.startswith(other) and other.startswith(package)
                for other in dirs
            ):
                found.add(name)
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed <= found, f"listed packages with no __init__.py: {sorted(listed - found)}"
