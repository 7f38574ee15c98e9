"""Start-up calibration: the engine's real step-cost curve and the PRM's batching curve,
medians over repeats, cached per model and machine.

- **Step cost** (``step_cost_curve``): full ``LLMEngine.step()`` time (schedule, forward,
  sampling, postprocess) of decode steps at batch sizes 1..``max_num_seqs`` (powers of two
  and the maximum), each the median of several steps, median over repeats in which the
  sizes take turns. CPU time of the engine thread on CPU (a shared machine's other load
  then barely moves it), wall time on CUDA. A line ``cost(b) =
  fixed + per_row * b`` fitted to all points gives the saturation batch: the largest ``b``
  whose step costs at most ``factor`` x a one-row step. Fitting every point (instead of
  picking the first power of two over a threshold) keeps two starts within a few percent.
- **Reward knee** (``reward_knee``): latency of scoring ``n`` traces' next step (their
  prefixes scored before, as lazy verification sees them) at ``n`` = 1..32; a line
  ``fixed + per_item * n`` gives the smallest batch whose cost per item is within 1.25x of a
  32-item batch's, in new-step tokens, and that batch's latency.
- **Cache** (``CalibrationCache``): JSON files in the user cache directory
  (``$SPEC_TOT_CACHE_DIR``, else ``$XDG_CACHE_HOME/spec-tot``, else ``~/.cache/spec-tot``),
  keyed by a hash of the model folder (config bytes, weight file names, sizes and mtimes),
  the engine settings that change step cost, the machine (CPU or GPU model, cores, torch
  threads) and the torch version. Never inside the installed package.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spec_tot.progress import timed_step
from spec_tot.requests import GenerateRequest, RewardItem, SamplingParams

from ..config import cache_root

__all__ = [
    "CalibrationCache",
    "calibrate_engine",
    "calibrate_prm",
    "disturbed",
    "fit_line",
    "model_fingerprint",
    "reward_knee",
    "saturation_from_curve",
    "step_cost_curve",
]

_VERSION = 2  # 2: step-cost curves time decode-only steps at every batch


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``(fixed, slope)`` of ``y = fixed + slope * x``."""
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - slope * mx, slope


def saturation_from_curve(curve: dict[int, float], limit: int, factor: float = 3.0) -> int:
    """Largest batch (<= ``limit``) whose step costs at most ``factor`` x one row's: on the
    line fitted to every point (overhead-bound curves, the usual case: robust to noise in
    any one point), or where the measured curve crosses it when that line has no fixed
    cost to speak of (a convex curve)."""
    fixed, per_row = fit_line(curve)
    if per_row <= 0:
        return limit
    if fixed > 0:
        one = fixed + per_row
        return max(1, min(limit, int((factor * one - fixed) / per_row)))
    target = factor * curve[min(curve)]
    points = sorted(curve.items())
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if t1 > target:
            return max(1, min(limit, int(b0 + (target - t0) / (t1 - t0) * (b1 - b0))))
    return limit


def disturbed(curve: dict[int, float], drop: float = 0.75) -> bool:
    """A step-cost curve no real engine has: a larger batch measured ``drop`` x or less
    of a smaller one's time. The machine was busy while it was measured (the median of a
    few steps still took the hit); such a curve is used for this start, never cached."""
    points = [t for _, t in sorted(curve.items())]
    return any(later <= drop * t for i, t in enumerate(points) for later in points[i + 1 :])


def _batches(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return [*out, limit]


def _clock(device: str) -> Callable[[], float]:
    """CPU time of this thread on CPU (other processes on a shared machine then barely move
    the figures; medians take care of the rest), wall time after a sync on CUDA."""
    if device.startswith("cuda"):

        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return wall
    return time.thread_time


def step_cost_curve(
    engine: Any, *, context: int = 64, steps: int = 6, repeats: int = 5
) -> dict[int, float]:
    """Median full step time (seconds) of decode steps at each batch size; the batch sizes
    take turns within each repeat, so drifting load touches every point alike."""
    limit = engine.config.max_num_seqs
    context = max(2, min(context, engine.max_len - steps - 2))
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(0)
    clock = _clock(engine.device)
    runs: dict[int, list[float]] = {b: [] for b in _batches(limit)}
    for rep in range(repeats + 1):  # the first round warms up
        for batch in runs:
            # A batch's prompts may need several steps (batch x context past the step's token
            # budget); rows whose prompt ended first decode meanwhile, so they get as many
            # more tokens as there are prompt steps, and every timed step has all ``batch``.
            prompt_steps = -(-batch * context // engine.config.max_num_batched_tokens)
            params = SamplingParams(
                temperature=0.8, max_tokens=steps + 2 + prompt_steps, ignore_eos=True, seed=0
            )
            for i in range(batch):
                ids = tuple(rng.randrange(vocab) for _ in range(context))
                rid = f"__calibration__/{batch}/{rep}/{i}"
                engine.add_request(GenerateRequest(rid, params, prompt_ids=ids, dedup=False))
            # The prompts, not timed (a decode step is what saturates): step until a step
            # decodes only. Timing a step that still prefills put a 256-row "decode" step
            # at 6x a 128-row one (its median mixed 4096-token prompt steps in).
            decoding = engine.counters.num_decode_steps
            for _ in range(prompt_steps + 1):
                engine.step()
                if engine.counters.num_decode_steps > decoding:
                    break
            times = []
            for _ in range(steps):
                start = clock()
                engine.step()
                times.append(clock() - start)
            engine.abort("__calibration__")
            if rep:
                runs[batch].append(statistics.median(times))
    engine.reset_counters()
    return {batch: statistics.median(times) for batch, times in runs.items()}


def _unique_trace(rng: random.Random, steps: int) -> RewardItem:
    def numbers() -> str:
        return " ".join(str(rng.randint(1, 13)) for _ in range(4))

    body = tuple(
        f"{rng.randint(1, 13)}+{rng.randint(1, 13)}=? (left: {numbers()})" for _ in range(steps)
    )
    return RewardItem(f"probe-{rng.random()}", numbers(), body)


def reward_knee(
    prm: Any, *, repeats: int = 5, step_tokens: Callable[[RewardItem], int] | None = None
) -> tuple[int, float, dict[int, float]]:
    """``(knee in new-step tokens, that batch's latency in s, {n: median latency})``; the
    batch sizes take turns within each repeat."""
    rng = random.Random(0)
    clock = _clock(str(prm.device))
    sizes = (1, 2, 4, 8, 16, 32)
    prm.score([_unique_trace(rng, 2) for _ in range(8)])  # warm-up
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    tokens: list[int] = []
    for _ in range(repeats):
        for n in sizes:
            items = [_unique_trace(rng, 2) for _ in range(n)]
            prm.score([RewardItem(i.request_id, i.question, i.steps[:1]) for i in items])
            start = clock()
            prm.score(items)
            runs[n].append(clock() - start)
            if step_tokens is not None:
                tokens.extend(step_tokens(i) for i in items)
    prm.clear_cache()
    curve = {n: statistics.median(times) for n, times in runs.items()}
    fixed, per_item = fit_line(curve)
    per_item = max(per_item, 1e-9)
    fixed = max(fixed, 0.0)
    # smallest n with fixed/n + per_item <= 1.25 * (fixed/32 + per_item)
    n_knee = fixed / (0.25 * per_item + 1.25 * fixed / 32) if fixed > 0 else 1.0
    n_knee = min(32.0, max(1.0, n_knee))
    item_tokens = statistics.fmean(tokens) if tokens else 1.0
    return max(1, round(n_knee * item_tokens)), fixed + per_item * n_knee, curve


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "machine": platform.machine(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__,
    }


def model_fingerprint(path: str | Path | None, config: dict[str, Any] | None) -> dict[str, Any]:
    """What identifies a model's cost: the folder's config bytes and weight files (names,
    sizes, mtimes; not their contents, which may be gigabytes), or a random model's config."""
    if path is None:
        return {"random": json.dumps(config or {}, sort_keys=True, default=str)}
    folder = Path(path)
    weights = [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(folder.glob("*.safetensors"))
    ]
    config_file = folder / "config.json"
    digest = hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.is_file() else ""
    return {"folder": str(folder.resolve()), "config": digest, "weights": weights}


class CalibrationCache:
    """One JSON file per calibration key under the user cache directory."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root if root is not None else cache_root()) / "calibration"

    def key(self, kind: str, what: dict[str, Any]) -> str:
        blob = json.dumps(
            {"v": _VERSION, "kind": kind, "machine": _machine(), **what},
            sort_keys=True,
            default=str,
        )
        return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            value = json.loads((self.root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def put(self, key: str, value: dict[str, Any]) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
            os.replace(tmp, self.root / f"{key}.json")  # atomic: a concurrent start reads whole
        except OSError:
            pass  # a read-only home only costs a calibration at the next start


def calibrate_engine(engine: Any, cache: CalibrationCache) -> tuple[int, dict[int, float]]:
    """``(saturation batch, step-cost curve)`` of ``engine``: the configured saturation
    batch with no curve, else the curve from the cache (a disturbed one is measured again,
    and only an undisturbed one is cached)."""
    cfg = engine.config
    if cfg.saturation_batch:
        return cfg.saturation_batch, {}
    what = {
        "model": model_fingerprint(cfg.model, cfg.model_config),
        "engine": [
            cfg.device,
            str(engine.dtype),  # "auto" resolved: a CPU may run a 16-bit checkpoint in bf16
            engine.loaded.weights,  # a GGUF's quantized steps cost their own
            cfg.block_size,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.mixed_steps,
            engine.runner.attention,
            engine.runner.graphs is not None,
        ],
    }
    key = cache.key("steps", what)
    hit = cache.get(key)
    curve = {}
    if hit is not None and isinstance(hit.get("curve"), dict):
        curve = {int(b): float(t) for b, t in hit["curve"].items()}
    if not curve or disturbed(curve):
        where = f"once per model and machine; cached in {cache.root}"
        with timed_step("calibrating the engine's step times", where), engine.plain_decoding():
            curve = step_cost_curve(engine)  # of plain decode steps
        if not disturbed(curve):
            cache.put(key, {"curve": {str(b): t for b, t in curve.items()}})
    engine.use_step_costs(curve)  # the token-speculation gate's prior
    return saturation_from_curve(curve, cfg.max_num_seqs), curve


def calibrate_prm(
    prm: Any, cache: CalibrationCache, step_tokens: Callable[[RewardItem], int]
) -> tuple[int, float]:
    """The PRM's reward knee ``(tokens, seconds)``, from the cache when known."""
    what = {"model": model_fingerprint(prm.folder, None), "prm": [prm.device, prm.max_len]}
    key = cache.key("reward", what)
    hit = cache.get(key)
    if hit is not None and {"tokens", "seconds"} <= hit.keys():
        return int(hit["tokens"]), float(hit["seconds"])
    with timed_step("calibrating the reward model's batch cost", f"cached in {cache.root}"):
        tokens, seconds, curve = reward_knee(prm, step_tokens=step_tokens)
    cache.put(key, {"tokens": tokens, "seconds": seconds, "curve": curve})
    return tokens, seconds
