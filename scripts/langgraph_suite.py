"""Run LangGraph's own test suite through spec-tot (not part of CI: ~3 minutes a mode).

The tests come from the PyPI sdist of the installed LangGraph version (downloaded once,
with ``pip download --no-deps --no-binary :all: langgraph==<version>``, into
``langgraph-tests/<version>`` in ``spec_tot.cache_dir.cache_root()``). Each
mode runs the whole suite (the Postgres/Redis/Docker ones skipped, as LangGraph's own
``NO_DOCKER=true`` does):

- ``plain``: LangGraph alone, the reference;
- ``baseline``: every ``StateGraph.compile()`` and ``@entrypoint`` routed through
  ``from_langgraph(mode="baseline")``;
- ``full``: the same in ``full`` mode, every node speculable except those judged to
  side-effect (``scripts/lg_suite_plugin.py``).

A test that passes in ``plain`` and not in another mode is listed with its message. The
suite needs its own test dependencies; ``--install-deps`` installs them::

    python scripts/langgraph_suite.py --install-deps
    python scripts/langgraph_suite.py --modes plain,baseline,full --out runs/lg-suite
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from spec_tot.cache_dir import cache_root

HERE = Path(__file__).resolve().parent
TEST_DEPS = [
    "pytest-mock",
    "syrupy",
    "langgraph-checkpoint-sqlite",
    "langgraph-checkpoint-postgres",
    "psycopg[binary]",
    "redis",
    "pycryptodome",
]
_IMPORTS = ["pytest_mock", "syrupy", "langgraph.checkpoint.sqlite", "psycopg", "redis", "Crypto"]
# Need services (Postgres, Docker) that LangGraph's NO_DOCKER switch does not skip.
_DESELECT = ["tests/test_prune_postgres.py"]


def cache_dir() -> Path:
    return cache_root() / "langgraph-tests" / importlib.metadata.version("langgraph")


def fetch(dest: Path) -> Path:
    """The installed LangGraph version's tests (downloaded and unpacked once)."""
    if (dest / "tests" / "conftest.py").exists():
        return dest
    version = importlib.metadata.version("langgraph")
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary"]
        subprocess.run([*pip, ":all:", f"langgraph=={version}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("langgraph-*.tar.gz")
        with tarfile.open(sdist) as tar:
            top = f"langgraph-{version}/"
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(f"{top}tests/") or m.name == f"{top}pyproject.toml"
            ]
            for m in members:
                m.name = m.name[len(top) :]
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
    return dest


def missing_deps() -> list[str]:
    return [m for m in _IMPORTS if importlib.util.find_spec(m.split(".")[0]) is None]


def run_mode(mode: str, suite: Path, out: Path, selection: list[str]) -> Path:
    xml = out / f"{mode}.xml"
    env = {
        **os.environ,
        "NO_DOCKER": "true",
        "SPEC_TOT_LG_MODE": mode,
        "SPEC_TOT_LG_STATS": str(out / f"{mode}-speculation.json"),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    args = [
        sys.executable,
        "-m",
        "pytest",
        *(selection or ["tests"]),
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    args += ["-p", "lg_suite_plugin", f"--junitxml={xml}", "-o", "addopts="]
    args += [f"--deselect={d}" for d in _DESELECT]
    subprocess.run(args, cwd=suite, env=env, check=False)
    return xml


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, first line of the message)."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                message = (
                    (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                )
                break
        out[name] = (status, message)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="plain,baseline,full")
    parser.add_argument("--out", type=Path, default=Path("runs/lg-suite"))
    parser.add_argument("--install-deps", action="store_true")
    parser.add_argument("tests", nargs="*", help="test files or ids (default: all)")
    args = parser.parse_args()
    if args.install_deps:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *TEST_DEPS], check=True)
    if missing := missing_deps():
        sys.exit(f"missing test dependencies {missing}: run with --install-deps")
    suite = fetch(cache_dir())
    args.out = args.out.resolve()  # pytest runs in the suite's folder: an absolute path
    args.out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    results = {m: outcomes(run_mode(m, suite, args.out, args.tests)) for m in modes}
    reference = results.get("plain")
    summary: dict[str, object] = {"langgraph": importlib.metadata.version("langgraph")}
    for mode, got in results.items():
        counts = {s: sum(v[0] == s for v in got.values()) for s in ("passed", "failed", "skipped")}
        entry: dict[str, object] = {"counts": counts}
        if reference is not None and mode != "plain":
            ok = [t for t, (s, _) in reference.items() if s == "passed"]
            lost = {
                t: got.get(t, ("missing", ""))[1] for t in ok if got.get(t, ("",))[0] != "passed"
            }
            entry["passing_in_plain"] = len(ok)
            entry["also_passing"] = len(ok) - len(lost)
            entry["regressions"] = lost
        stats = args.out / f"{mode}-speculation.json"
        if stats.exists():
            entry["speculation"] = json.loads(stats.read_text())
        summary[mode] = entry
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    for mode in modes:
        entry = summary[mode]
        assert isinstance(entry, dict)
        line = f"{mode}: {entry['counts']}"
        if "also_passing" in entry:
            line += f"; {entry['also_passing']}/{entry['passing_in_plain']} of plain's passes"
        print(line)


if __name__ == "__main__":
    main()
