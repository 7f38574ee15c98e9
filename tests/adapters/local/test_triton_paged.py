"""The Triton paged decode-attention kernel (the CUDA decode path) against the gather + SDPA
reference, run on CPU through Triton's interpreter (``TRITON_INTERPRET=1``); skipped where
Triton is not installed (it is in the test extra)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import attention_case, reference_attention

from spec_tot.adapters.local.model.triton_paged import TritonPagedKernel, load_triton_kernel

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]' has it)")


@pytest.fixture(scope="module")
def kernel() -> TritonPagedKernel:
    # on CPU, tests/conftest.py has set TRITON_INTERPRET=1 before triton was imported
    device = "cuda" if torch.cuda.is_available() else "cpu"
    built, why = load_triton_kernel(device)
    assert built is not None, why
    return built


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [t.to(device) for t in tensors]


def test_not_offered_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    built, why = load_triton_kernel("cpu")
    assert built is None and "CUDA" in why


@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "dim", "longest"),
    [
        (1, 4, 4, 32, 1),  # one row, one token of context
        (7, 4, 4, 32, 50),  # the random 4 x 128 Llama's heads
        (9, 9, 3, 64, 112),  # SmolLM2's GQA 9/3, contexts across BLOCK_N tiles
        (3, 6, 3, 48, 40),  # a head size that is not a power of two: masked lanes
    ],
)
def test_kernel_matches_gather_and_sdpa(
    kernel: TritonPagedKernel, n: int, heads: int, kv_heads: int, dim: int, longest: int
) -> None:
    q, k_pool, v_pool, tables, lengths = attention_case(n, heads, kv_heads, dim, longest, seed=n)
    scale = dim**-0.5
    got = kernel.attend(*_on_device(q, k_pool, v_pool, tables, lengths), scale).cpu()
    want = reference_attention(q, k_pool, v_pool, tables, lengths, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_tables_wider_than_needed_and_strided(kernel: TritonPagedKernel) -> None:
    """The graph path hands a view ``[:n]`` of a static ``[max_tokens, max_blocks]`` table:
    columns past a context's last block hold stale ids and are never read."""
    q, k_pool, v_pool, tables, lengths = attention_case(5, 4, 2, 32, 40, seed=3)
    wide = torch.full((8, tables.shape[1] + 6), 10**9, dtype=torch.int64)
    wide[:5, : tables.shape[1]] = tables
    got = kernel.attend(*_on_device(q, k_pool, v_pool, wide[:5], lengths), 0.2).cpu()
    want = reference_attention(q, k_pool, v_pool, tables, lengths, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
