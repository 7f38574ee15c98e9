"""The fused paged decode-attention kernel against a plain gather + SDPA reference, its
refusals, its build cache and the fallback when no compiler builds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from attention_cases import attention_case as _case
from attention_cases import reference_attention as _reference
from engine_fixtures import built_kernel, make_engine, tiny_llama

from spec_tot.adapters.local.model import c_kernels
from spec_tot.adapters.local.model.paged_kernel import PagedDecodeKernel, load_paged_kernel

__all__ = ["make_engine", "tiny_llama"]  # fixtures, imported for pytest


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    return built_kernel(load_paged_kernel, tmp_path_factory.mktemp("cache"), "the paged kernel")


@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "dim", "longest"),
    [
        (1, 4, 4, 32, 1),  # one row, one token of context
        (7, 4, 4, 32, 50),  # the random 4 x 128 Llama's heads
        (64, 9, 3, 64, 112),  # SmolLM2's GQA 9/3
        (5, 8, 2, 128, 33),
        (3, 6, 3, 48, 40),  # a head size with no unrolled variant: the generic loop
    ],
)
def test_kernel_matches_gather_and_sdpa(
    kernel: PagedDecodeKernel, n: int, heads: int, kv_heads: int, dim: int, longest: int
) -> None:
    q, k_pool, v_pool, tables, lengths = _case(n, heads, kv_heads, dim, longest, seed=n)
    scale = dim**-0.5
    got = kernel.attend(q, k_pool, v_pool, tables, lengths, scale)
    want = _reference(q, k_pool, v_pool, tables, lengths, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_kernel_result_does_not_depend_on_threads(kernel: PagedDecodeKernel) -> None:
    """One work item per (row, KV head), each computed whole by one thread: the thread count
    changes who computes an item, never its arithmetic."""
    q, k_pool, v_pool, tables, lengths = _case(16, 9, 3, 64, 80, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(q, k_pool, v_pool, tables, lengths, 0.125)
        torch.set_num_threads(2)
        two = kernel.attend(q, k_pool, v_pool, tables, lengths, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_kernel_refuses_reads_outside_the_pool(kernel: PagedDecodeKernel) -> None:
    q, k_pool, v_pool, tables, lengths = _case(2, 4, 4, 32, 20, seed=1)
    bad = tables.clone()
    bad[1, 0] = k_pool.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        kernel.attend(q, k_pool, v_pool, bad, lengths, 1.0)
    too_long = lengths.clone()
    too_long[0] = tables.shape[1] * k_pool.shape[1] + 1
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kernel.attend(q, k_pool, v_pool, tables, too_long, 1.0)


def test_build_is_cached_and_keyed(tmp_path: Path) -> None:
    first, _ = load_paged_kernel(tmp_path)
    assert first is not None
    built = Path(first.path)
    stamp = built.stat().st_mtime_ns
    second, _ = load_paged_kernel(tmp_path)
    assert second is not None and second.path == first.path
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.name]  # no leftovers


def test_no_compiler_falls_back_to_sparse(
    make_engine: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a working compiler ``"auto"`` keeps the sparse path and says why; asking for
    ``"paged"`` is a ConfigError naming the field."""
    from spec_tot.errors import ConfigError

    monkeypatch.setenv("SPEC_TOT_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(c_kernels, "_compiler", lambda: ["false"])
    kernel, why = load_paged_kernel()
    assert kernel is None and why.startswith("false")
    with caplog.at_level("WARNING", logger="spec_tot.engine"):
        engine = make_engine()
    assert engine.runner.attention == "sparse" and engine.runner.kernel_note
    assert engine.runner.kernel_note in caplog.text  # the user is told why
    with pytest.raises(ConfigError, match="attention"):
        make_engine(attention="paged")
    monkeypatch.setattr(c_kernels, "_compiler", lambda: None)
    assert load_paged_kernel()[1].startswith("no C compiler")
