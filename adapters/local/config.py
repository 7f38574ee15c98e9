"""Engine configuration: frozen, validated at construction (``ConfigError`` names the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spec_tot.cache_dir import cache_root
from spec_tot.errors import ConfigError

__all__ = [
    "ATTENTION_MODES",
    "DTYPES",
    "LAUNCHERS",
    "MAX_KV_BLOCKS",
    "MAX_KV_TOKENS",
    "SIZE_BOUNDS",
    "WEIGHTS",
    "CoreOptions",
    "EngineConfig",
    "PrmConfig",
    "SyntheticWorkload",
    "cache_root",
    "check_bound",
    "check_kv_pool",
    "resolve_device",
    "resolve_dtype",
]

# Upper bounds of the options that size memory or time, checked before anything loads. The
# block manager keeps one Python object per KV block (~0.2 KB: a million blocks is ~200 MB
# before any tensor), so the pool's block count has a bound of its own beside its tokens.
# A value past a bound is a ConfigError naming the option, the value and the bound.
MAX_KV_BLOCKS = 1 << 20
MAX_KV_TOKENS = 1 << 24
SIZE_BOUNDS: dict[str, int] = {
    "block_size": 1024,
    "num_kv_blocks": MAX_KV_BLOCKS,
    "max_num_seqs": 1 << 14,
    "max_model_len": 1 << 20,
    "max_num_batched_tokens": 1 << 20,
    "max_draft_tokens": 256,
    "ngram_max": 64,
    "ngram_min": 64,
    "threads": 4096,
}
MAX_START_TIMEOUT_S = 24 * 3600.0


def check_bound(name: str, value: float, high: float, shown: str | None = None) -> None:
    if value > high:
        raise ConfigError(shown or name, f"{value} is over the bound of {high}")


def check_kv_pool(num_blocks: int, block_size: int, prefix: str = "") -> None:
    """The pool's block count and its tokens (blocks x block size) within their bounds."""
    check_bound("num_kv_blocks", num_blocks, MAX_KV_BLOCKS, prefix + "num_kv_blocks")
    tokens = num_blocks * block_size
    if tokens > MAX_KV_TOKENS:
        raise ConfigError(
            prefix + "num_kv_blocks",
            f"{num_blocks} blocks of {block_size} tokens hold {tokens} tokens, over the bound "
            f"of {MAX_KV_TOKENS}",
        )


# ``EngineConfig.weights``: the model's float weights only, or also its GGUF's quantized
# matrices at decode steps (``model/gguf_weights.py``), or "auto": the GGUF's wherever they run.
WEIGHTS = ("auto", "float", "gguf")
# Names accepted for ``EngineConfig.dtype``; "auto" picks bfloat16 on CUDA, float32 on CPU
# (for a model folder whose checkpoint ships in 16 bits: bfloat16 where it measured faster,
# ``model/dtype_choice.py``).
DTYPES = ("auto", "float32", "float16", "bfloat16")
# Names accepted for ``EngineConfig.attention`` (the decode paths of ``runner.ModelRunner``).
ATTENTION_MODES = ("auto", "paged", "sparse", "gather")


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Workload model for throughput studies with random-weight models of real size.

    Forward passes are real; only *what* is generated is synthetic. Each logical sample stops
    after a lognormal number of tokens (``exp(N(step_len_mu, step_len_sigma))``, capped by
    ``max_tokens``), drawn from a generator seeded by (``seed``, request id, member index) so a
    run is reproducible. Text prompts without a tokenizer are mapped to ids by a pseudo
    tokenizer (4 characters a token) that keeps shared text prefixes shared in id space.
    ``prompt_len_mu``/``prompt_len_sigma`` size prompts made by ``sample_prompt``.
    """

    seed: int = 0
    step_len_mu: float = 4.0
    step_len_sigma: float = 0.6
    prompt_len_mu: float = 5.0
    prompt_len_sigma: float = 0.5
    min_step_len: int = 1

    def __post_init__(self) -> None:
        for name in ("step_len_mu", "step_len_sigma", "prompt_len_mu", "prompt_len_sigma"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"synthetic.{name}", f"must be finite, got {value}")
        if self.step_len_sigma < 0 or self.prompt_len_sigma < 0:
            raise ConfigError("synthetic.step_len_sigma", "sigmas must be >= 0")
        if self.min_step_len < 1:
            raise ConfigError("synthetic.min_step_len", f"must be >= 1, got {self.min_step_len}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs. Exactly one of ``model`` (a local Hugging Face folder) and
    ``model_config`` (a config dict: random weights, no file) is set.

    ``weights``: ``"float"`` runs the folder's float weights; ``"gguf"`` also reads its
    ``model.gguf`` (``scripts/fetch_smollm2.py`` keeps it) and runs its Q4_0 / Q4_1 / Q8_0 matrices
    at the decode steps where they measured faster (CPU, float32: ``model/gguf_weights.py``;
    inputs quantized to int8 per 32 as llama.cpp does, so outputs move by about 1%).
    ``"auto"`` (the default): ``"gguf"`` where the folder has a ``model.gguf`` and the
    engine runs float32 on the CPU with its C kernel built (the weights as the model ships,
    1.4-2x float at one to four rows here), else ``"float"``.
    ``num_kv_blocks`` sizes the paged KV pool (``block_size`` tokens a block).
    ``saturation_batch``: ``None`` measures it at start-up (the engine's full step cost vs
    batch size, cached per model and machine), an int is taken as given.
    ``mixed_steps``: decode rows and prompt chunks share a step under a budget of
    ``max_num_batched_tokens`` tokens (False: the older all-prefill / all-decode steps, whole
    prompts, kept for comparison). ``attention``: ``"paged"`` runs decode rows through a fused
    C kernel over the KV pool (built on first use with the machine's C compiler),
    ``"sparse"`` reads the pool in place through sparse products, ``"gather"`` gathers
    contexts for SDPA; ``"auto"`` picks paged on CPU (float32; sparse where no kernel
    builds), gather elsewhere. ``cuda_graphs`` (CUDA only; ignored on CPU): steps whose
    every token attends through the paged kernel replay from CUDA graphs captured per
    padded token-count bucket (``cuda_graphs.py``).

    Token-level speculative decoding (``tokenspec.py``): ``token_speculation`` is the one
    switch; drafts of up to ``max_draft_tokens`` tokens come from the program's ``drafter``
    (a ``"module:attr"`` factory of a ``drafter.Drafter``, given the tokenizer), a
    ``draft_model`` folder (the draft-model seam), and prompt lookup over the sequence and
    its tree (n-grams of ``ngram_min`` .. ``ngram_max`` tokens; ``ngram_max=0``, the default,
    turns it off: alone it measured slower than plain decoding at batch 8 and 32 on the main
    job's traces and on SmolLM2-135M, ``benchmarks/results/token_spec_*.json``).
    """

    model: str | None = None
    model_config: dict[str, Any] | None = None
    device: str = "cpu"
    dtype: str = "auto"
    weights: str = "auto"
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_dedup: bool = True
    seed: int = 0
    saturation_batch: int | None = None
    mixed_steps: bool = True
    attention: str = "auto"
    cuda_graphs: bool = True
    synthetic: SyntheticWorkload | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    token_speculation: bool = True
    max_draft_tokens: int = 16
    drafter: str | None = None
    draft_model: str | None = None
    ngram_max: int = 0
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if (self.model is None) == (self.model_config is None):
            raise ConfigError("model", "set exactly one of model (a folder) and model_config")
        if self.model is not None and not self.model:
            raise ConfigError("model", "must be a non-empty path")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError("device", f"must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError("weights", f"must be one of {WEIGHTS}, got {self.weights!r}")
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_model_len",
            "max_num_batched_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(name, f"must be an int, got {value!r}")
            if value < 1:
                raise ConfigError(name, f"must be >= 1, got {value}")
            check_bound(name, value, SIZE_BOUNDS[name])
        check_kv_pool(self.num_kv_blocks, self.block_size)
        for name in ("enable_prefix_caching", "enable_dedup", "mixed_steps", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError("seed", f"must be an int, got {self.seed!r}")
        if not self.mixed_steps and self.max_num_batched_tokens < self.max_model_len:
            # Legacy steps prefill whole prompts: the longest prompt must fit in one step.
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.max_model_len}), got "
                f"{self.max_num_batched_tokens}",
            )
        if self.attention not in ATTENTION_MODES:
            names = ", ".join(repr(m) for m in ATTENTION_MODES)
            raise ConfigError("attention", f"must be one of {names}, got {self.attention!r}")
        sat = self.saturation_batch
        if sat is not None and (not isinstance(sat, int) or isinstance(sat, bool) or sat < 1):
            raise ConfigError("saturation_batch", f"must be an int >= 1, got {sat!r}")
        self._check_token_speculation()

    def _check_token_speculation(self) -> None:
        if not isinstance(self.token_speculation, bool):
            raise ConfigError(
                "token_speculation", f"must be a bool, got {self.token_speculation!r}"
            )
        for name, low in (("max_draft_tokens", 1), ("ngram_max", 0), ("ngram_min", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(name, f"must be an int >= {low}, got {value!r}")
            check_bound(name, value, SIZE_BOUNDS[name])
        if self.ngram_max and self.ngram_min > self.ngram_max:
            raise ConfigError(
                "ngram_min", f"must be <= ngram_max ({self.ngram_max}), got {self.ngram_min}"
            )
        for name in ("drafter", "draft_model"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"must be a non-empty string or None, got {value!r}")
        if self.drafter is not None and ":" not in self.drafter:
            raise ConfigError(
                "drafter", f"must name a factory as 'module:attr', got {self.drafter!r}"
            )


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} requested but CUDA is not available")
    return name


def resolve_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


@dataclass(frozen=True)
class PrmConfig:
    """The process reward model: a local folder with ``prm.json`` (see ``prm.py``), on
    ``device``/``dtype`` as ``EngineConfig`` reads them, with its own prefix-cache pool of
    ``num_kv_blocks`` blocks of ``block_size`` tokens."""

    path: str
    device: str = "cpu"
    dtype: str = "auto"
    num_kv_blocks: int = 4096
    block_size: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("prm_path", "must be a non-empty path")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("num_kv_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"prm_{name}", f"must be an int >= 1, got {value!r}")
        check_bound("block_size", self.block_size, SIZE_BOUNDS["block_size"], "prm_block_size")
        check_kv_pool(self.num_kv_blocks, self.block_size, "prm_")


LAUNCHERS = ("auto", "fork", "spawn")


@dataclass(frozen=True)
class CoreOptions:
    """Where the engine core runs (``LocalBackend``; see ``proc.py``).

    ``process``: the scheduler, model runner, block manager, sampler and PRM run in a child
    process (the default), or, with False, in a worker thread of the caller's process (for
    debugging and for tests that reach into the engine). ``threads``: torch's intra-op
    threads in the child (None: every core this process may use but one, left to the
    caller, or every core with ``caller_core`` False, as ``spec-tot serve`` runs: its
    caller only moves HTTP; ``proc.default_threads`` has the measurements; the caller's own
    torch setting is never touched). ``prm_process``: the PRM
    gets a child of its own instead of a thread beside the engine in one child (the two then
    share that child's GIL: measured on 2 cores, main job, five interleaved rounds, vs the
    in-thread engine: 2.15x / 1.35x / 1.09x at 1 / 32 / 64 queries with its own child,
    1.59x / 1.22x / 1.23x sharing one). None (the default): a child of its own on CPU, one
    child for both on CUDA, where two processes share the GPU only by time slices (their
    kernels never overlap) and one process's threads share a CUDA context (the PRM scores
    on a stream of its own). On an H200 before CUDA graphs the main job at one query ran
    0.73 q/s with the PRM in the engine's process vs 0.56-0.66 in its own; with graphs the
    engine's GPU time a step was 5.9 ms through the executor with the PRM's process beside
    it vs 0.54 ms with no PRM calls (``benchmarks/results/h200/pipeline_cuda.json``). With
    ``threads`` None and two children, the PRM child gets a third of the cores but one and
    the engine the rest (1 and 1 on 2 cores). ``launcher``:
    ``"fork"`` forks each child from a warm fork server (torch already imported: a start
    costs the model load only), ``"spawn"`` starts a fresh interpreter, ``"auto"`` forks on
    Linux. ``start_timeout_s`` bounds the start
    (model load and calibration included). ``hook``: ``"module:function"`` called with the
    ``EngineCore`` once it is built, in the process that runs it (instrumentation, tests).
    """

    process: bool = True
    threads: int | None = None
    prm_process: bool | None = None
    launcher: str = "auto"
    start_timeout_s: float = 600.0
    hook: str | None = None
    caller_core: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.process, bool):
            raise ConfigError("process", f"must be a bool, got {self.process!r}")
        if not isinstance(self.caller_core, bool):
            raise ConfigError("caller_core", f"must be a bool, got {self.caller_core!r}")
        if self.prm_process is not None and not isinstance(self.prm_process, bool):
            raise ConfigError("prm_process", f"must be a bool or None, got {self.prm_process!r}")
        threads = self.threads
        if threads is not None and (
            not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
        ):
            raise ConfigError("threads", f"must be an int >= 1 or None, got {threads!r}")
        if threads is not None:
            check_bound("threads", threads, SIZE_BOUNDS["threads"])
        if self.launcher not in LAUNCHERS:
            raise ConfigError("launcher", f"must be one of {LAUNCHERS}, got {self.launcher!r}")
        timeout = self.start_timeout_s
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError("start_timeout_s", f"must be > 0, got {timeout!r}")
        check_bound("start_timeout_s", timeout, MAX_START_TIMEOUT_S)
        if self.hook is not None and (not isinstance(self.hook, str) or ":" not in self.hook):
            raise ConfigError("core_hook", f"must be 'module:function', got {self.hook!r}")
