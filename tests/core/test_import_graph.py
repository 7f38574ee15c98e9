"""The core's modules import one another without a cycle (function-level imports and
``if TYPE_CHECKING:`` blocks included: a cycle of types is a cycle a reader must hold in
their head), and plug-ins use public names only: graphs/, adapters/, examples/ and
benchmarks/ never import a private module of the core (``spec_tot._private``,
``spec_tot.cli._checks``, ...; any import included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import spec_tot

CORE = Path(spec_tot.__file__).parent
REPO = Path(__file__).resolve().parents[2]
PLUG_INS = ("graphs", "adapters", "examples", "benchmarks")


def _module_name(path: Path) -> str:
    parts = ["spec_tot", *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str) -> list[str]:
    """Every module (and module.name) ``source`` imports, wherever: top level, in functions,
    under ``if TYPE_CHECKING:``."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports."""
    return {
        name: {t for t in imports_of(text) if t in sources and t != name}
        for name, text in sources.items()
    }


def core_import_graph() -> dict[str, set[str]]:
    return import_graph({_module_name(p): p.read_text() for p in CORE.rglob("*.py")})


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None. Edges into a package's
    ``__init__`` from the package's own submodules count; the package importing its
    submodules does too, so a submodule importing its own package is a cycle."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in colour and (found := dfs(nxt)) is not None:
                return found
        stack.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if start not in colour and (found := dfs(start)) is not None:
            return found
    return None


def test_the_core_has_no_import_cycle() -> None:
    graph = core_import_graph()
    # the package root re-exports the public API; every submodule is under it
    graph.pop("spec_tot", None)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_node_vocabulary_is_a_leaf() -> None:
    graph = core_import_graph()
    # backends: the RewardBackend a reward node may name (a type; the contracts module
    # imports nothing of the graph)
    assert graph["spec_tot.graph_nodes"] <= {
        "spec_tot.requests",
        "spec_tot.errors",
        "spec_tot.backends",
    }
    assert not graph["spec_tot.backends"] & {"spec_tot.graph", "spec_tot.graph_nodes"}


def layer_imports(folder: Path, package: str) -> dict[str, set[str]]:
    """Module of ``folder`` -> every module it imports (absolute, relative resolved against
    ``package``, the dotted name of ``folder``), anywhere in the file."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        here = ".".join([package, *parts[:-1]])  # the package a relative import starts from
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
                module = module if node.level else (node.module or "")
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(REPO))] = names
    return found


def test_the_model_layer_imports_nothing_above_it() -> None:
    """``adapters/local/model/`` (the network, its kernels) sits below the scheduler: it takes
    what it needs as its own types (``model/step_rows.py``), never the engine's, the engine
    process's or the server's."""
    model = REPO / "adapters" / "local" / "model"
    above = ("engine", "core", "serve", "backend")
    offenders = [
        f"{path}: {name}"
        for path, names in layer_imports(model, "spec_tot.adapters.local.model").items()
        for name in names
        if any((name + ".").startswith(f"spec_tot.adapters.local.{layer}.") for layer in above)
    ]
    assert not offenders, "\n".join(offenders)
    planted = layer_imports(
        REPO / "adapters" / "local" / "engine", "spec_tot.adapters.local.engine"
    )
    assert any(
        n.startswith("spec_tot.adapters.local.model.") for names in planted.values() for n in names
    ), "the check resolves relative imports (the engine imports the model layer)"


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_cycle_through_a_type_checking_import_is_found() -> None:
    planted = {
        "pkg.a": "from pkg.b import run\n",
        "pkg.b": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.a import Thing\n"
            "def run(x: 'Thing') -> None: ...\n"
        ),
    }
    assert find_cycle(import_graph(planted)) == ["pkg.a", "pkg.b", "pkg.a"]
    planted["pkg.b"] = "def run() -> None:\n    from pkg.a import Thing\n"
    assert find_cycle(import_graph(planted)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_importing_spec_tot_leaves_langgraph_and_the_chat_models_unloaded() -> None:
    """``import spec_tot`` stays light (a CLI start, a worker process such as the engine's
    own): LangChain, LangGraph and the chat models load on first use of a name that needs
    them, and then resolve as usual."""
    code = (
        "import sys, spec_tot, spec_tot.adapters.local.core.core_process\n"
        "heavy = [m for m in ('langchain_core', 'langgraph', 'spec_tot.langgraph',"
        " 'spec_tot.chat_model', 'spec_tot.chat_spec_tot') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'ToTApp' in dir(spec_tot) and spec_tot.ToTApp.__module__ == 'spec_tot.app'\n"
        "from spec_tot import ChatSpecTot, ToTChatModel, from_langgraph\n"
        "assert 'langgraph' in sys.modules and callable(from_langgraph)\n"
        "assert ChatSpecTot.__module__ == 'spec_tot.chat_spec_tot'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def private_imports(source: str, own: str | None = None) -> list[str]:
    """The modules ``source`` imports (anywhere, TYPE_CHECKING included) that are private to
    spec-tot: a dotted path under ``spec_tot`` with a component starting with ``_``. A
    package's own private modules (``own``, e.g. ``spec_tot.adapters``) are its business."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "spec_tot" or (own and (name + ".").startswith(own + ".")):
                continue
            if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                found.append(name)
    return found


def test_plug_ins_import_no_private_module_of_the_core() -> None:
    offenders = []
    for folder in PLUG_INS:
        root = REPO / folder
        assert root.is_dir(), root
        own = "spec_tot.adapters" if folder == "adapters" else None
        for path in sorted(root.rglob("*.py")):
            for name in private_imports(path.read_text(), own):
                offenders.append(f"{path.relative_to(REPO)}: {name}")
    assert not offenders, "\n".join(offenders)


def test_the_private_import_check_finds_them() -> None:
    assert private_imports("from spec_tot._private.threads import run_sync") == [
        "spec_tot._private.threads",
        "spec_tot._private.threads.run_sync",
    ]
    assert private_imports("import spec_tot.cli._checks as c") == ["spec_tot.cli._checks"]
    typed = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spec_tot._private import x"
    )
    assert private_imports(typed) == ["spec_tot._private", "spec_tot._private.x"]
    assert private_imports("from spec_tot.backends import _MASK63") == ["spec_tot.backends._MASK63"]
    own = "from spec_tot.adapters._sim_loop import SimEngine"
    assert private_imports(own, "spec_tot.adapters") == []
    assert private_imports(own) == [
        "spec_tot.adapters._sim_loop",
        "spec_tot.adapters._sim_loop.SimEngine",
    ]
    assert private_imports("from spec_tot.backends import matches_prefix\nimport json") == []
