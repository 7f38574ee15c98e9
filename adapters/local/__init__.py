"""The embedded inference engine (nano-vllm style): the default backend.

``create_local(policy_path=..., prm_path=..., **engine options)`` builds a ``LocalBackend``
whose engine core runs in a child process, started by ``await backend.start()`` (or a first
request); torch and transformers are imported there (and in this process only with
``process=False``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import LocalBackend
    from .config import CoreOptions, EngineConfig, PrmConfig, SyntheticWorkload
    from .engine.llm_engine import LLMEngine

__all__ = [
    "CoreOptions",
    "EngineConfig",
    "LLMEngine",
    "LocalBackend",
    "PrmConfig",
    "SyntheticWorkload",
    "create_local",
]


def create_local(
    policy_path: str | None = None,
    prm_path: str | None = None,
    *,
    process: bool = True,
    threads: int | None = None,
    prm_process: bool | None = None,
    launcher: str = "auto",
    core_hook: str | None = None,
    caller_core: bool = True,
    **options: Any,
) -> LocalBackend:
    """A ``LocalBackend`` for a local Hugging Face folder (``policy_path``), or for a
    random-weight model (``model_config={...}``), plus an optional PRM folder. ``options`` are
    ``EngineConfig`` fields (``synthetic`` may be a dict of ``SyntheticWorkload`` fields), and
    ``prm_num_kv_blocks`` / ``prm_block_size`` size the PRM's own prefix-cache pool.
    ``process``, ``threads``, ``prm_process``, ``launcher``, ``core_hook`` and
    ``caller_core`` say where the engine core runs (``CoreOptions``: a child process by
    default, started by ``start()``).
    Every option and both folders are checked here; nothing loads until it starts."""
    from .backend import LocalBackend
    from .config import (
        CoreOptions,
        EngineConfig,
        PrmConfig,
        SyntheticWorkload,
    )
    from .model.model_files import check_model_folder

    synthetic = options.pop("synthetic", None)
    prm_options = {
        key.removeprefix("prm_"): options.pop(key)
        for key in ("prm_num_kv_blocks", "prm_block_size")
        if key in options
    }
    if isinstance(synthetic, dict):
        synthetic = SyntheticWorkload(**synthetic)
    core = CoreOptions(
        process, threads, prm_process, launcher, hook=core_hook, caller_core=caller_core
    )
    engine = None
    if policy_path is not None or options.get("model_config") is not None:
        engine = EngineConfig(model=policy_path, synthetic=synthetic, **options)
        if policy_path is not None:
            check_model_folder(policy_path, "policy_path")
    prm = None
    if prm_path is not None:
        check_model_folder(prm_path, "prm_path", needs=("prm.json",))
        device = options.get("device", "cpu")
        dtype = options.get("dtype", "auto")
        prm = PrmConfig(prm_path, device, dtype, **prm_options)
    return LocalBackend(engine, prm, options=core)


def __getattr__(name: str) -> Any:  # lazy re-exports: importing the package stays cheap
    if name == "LocalBackend":
        from .backend import LocalBackend

        return LocalBackend
    if name in ("CoreOptions", "EngineConfig", "PrmConfig", "SyntheticWorkload"):
        from . import config

        return getattr(config, name)
    if name == "LLMEngine":
        from .engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
