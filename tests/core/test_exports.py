"""The public surface is small and pinned: changing it is a deliberate act."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import spec_tot

EXPECTED = {
    "END",
    "START",
    "BackendRegistry",
    "BatchResult",
    "ChatSpecTot",
    "DraftContext",
    "Drafter",
    "ExecutorConfig",
    "GenerationBackend",
    "LangChainBackend",
    "RewardBackend",
    "RewardItem",
    "RunnableReward",
    "SamplingParams",
    "SearchPolicy",
    "ThoughtGraph",
    "ToTApp",
    "ToTChatModel",
    "ToTResult",
    "__version__",
    "add_tool",
    "create_policy",
    "default_registry",
    "from_langgraph",
    "policy_names",
    "tool_node",
}


def test_top_level_all_is_pinned() -> None:
    assert set(spec_tot.__all__) == EXPECTED
    for name in spec_tot.__all__:
        assert hasattr(spec_tot, name), name


def test_every_module_declares_all_and_exports_exist() -> None:
    missing = []
    for info in pkgutil.walk_packages(spec_tot.__path__, "spec_tot."):
        module = importlib.import_module(info.name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            missing.append(info.name)
            continue
        for name in exported:
            assert hasattr(module, name), f"{info.name}.{name}"
    assert not missing, f"modules without __all__: {missing}"


def test_graphs_and_adapters_are_subpackages_not_top_level(tmp_path: Path) -> None:
    import spec_tot.adapters
    import spec_tot.graphs

    assert spec_tot.adapters.__name__ == "spec_tot.adapters"
    assert spec_tot.graphs.__name__ == "spec_tot.graphs"
    # From a folder outside the checkout, the installed distribution must not provide them.
    probe = "import importlib.util as u; print(u.find_spec('graphs'), u.find_spec('adapters'))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None None"
