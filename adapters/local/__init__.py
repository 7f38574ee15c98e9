"""The embedded inference engine (nano-vllm style): the default backend.

``create_local(policy_path=..., prm_path=..., **engine options)`` builds a ``LocalBackend``;
heavy modules (torch, transformers) are imported only when it is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import LocalBackend
    from .config import EngineConfig, SyntheticWorkload
    from .engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine", "LocalBackend", "SyntheticWorkload", "create_local"]


def create_local(
    policy_path: str | None = None,
    prm_path: str | None = None,
    **options: Any,
) -> LocalBackend:
    """A ``LocalBackend`` for a local Hugging Face folder (``policy_path``), or for a
    random-weight model (``model_config={...}``), plus an optional PRM folder. ``options`` are
    ``EngineConfig`` fields (``synthetic`` may be a dict of ``SyntheticWorkload`` fields), and
    ``prm_num_kv_blocks`` / ``prm_block_size`` size the PRM's own prefix-cache pool."""
    from .backend import LocalBackend
    from .config import EngineConfig, SyntheticWorkload, resolve_device, resolve_dtype
    from .engine import LLMEngine
    from .prm import PrmScorer

    synthetic = options.pop("synthetic", None)
    prm_options = {
        key.removeprefix("prm_"): options.pop(key)
        for key in ("prm_num_kv_blocks", "prm_block_size")
        if key in options
    }
    if isinstance(synthetic, dict):
        synthetic = SyntheticWorkload(**synthetic)
    engine = None
    if policy_path is not None or options.get("model_config") is not None:
        config = EngineConfig(model=policy_path, synthetic=synthetic, **options)
        engine = LLMEngine(config)
    prm = None
    if prm_path is not None:
        device = resolve_device(options.get("device", "cpu"))
        dtype = resolve_dtype(options.get("dtype", "auto"), device)
        prm = PrmScorer(prm_path, device, dtype, **prm_options)
    return LocalBackend(engine, prm)


def __getattr__(name: str) -> Any:  # lazy re-exports: importing the package stays cheap
    if name == "LocalBackend":
        from .backend import LocalBackend

        return LocalBackend
    if name in ("EngineConfig", "SyntheticWorkload"):
        from . import config

        return getattr(config, name)
    if name == "LLMEngine":
        from .engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
