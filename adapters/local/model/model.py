"""Llama / Qwen2 decoder in plain torch over a paged KV cache, on a packed step.

A step's tokens, from every row (decode rows and prefill chunks alike), are one flat list
``[T]``: every linear layer runs once on ``[T, hidden]`` with no padding. Each layer writes
the new K/V into the pool through ``slot_mapping`` and then attends (``attention.py``):
decode rows read the pool in place, prefill chunks through a gather of their context.
Everything that depends only on the step (slots, masks, sparsity pattern, RoPE rows) is
built once per step in ``StepInputs``, not per layer. q/k/v and gate/up are fused at load
time: fewer kernel launches per layer. Every matmul goes through a ``Linear`` (``linear.py``:
oneDNN with pre-packed weights on CPU in float32, ``F.linear`` elsewhere), built once the
weights are final.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DenseMeta, PagedMeta, SparseMeta, dense_attention, pool_attention
from .host_copy import to_device
from .linear import Linear, QuantPath

__all__ = [
    "DecoderModel",
    "KVCache",
    "ModelArgs",
    "StepInputs",
    "rope_inv_freq",
    "rope_tables",
]


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, config: Any) -> ModelArgs:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        eos = config.eos_token_id
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        # Qwen2 always has q/k/v biases; Llama has them only with ``attention_bias``.
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bias,
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them
    (``rope_parameters`` in transformers 5, ``rope_theta``/``rope_scaling`` before)."""
    params = getattr(config, "rope_parameters", None) or {}
    legacy = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type")
    if rope_type and rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
    theta = float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponent), 1.0


@dataclass(slots=True)
class KVCache:
    """Per-layer K and V pools ``[num_blocks + 1, block_size, n_kv_heads, head_dim]``; the
    last block is scratch (padding writes land there and are never read unmasked)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls, args: ModelArgs, num_blocks: int, block_size: int, device: str, dtype: torch.dtype
    ) -> KVCache:
        shape = (num_blocks + 1, block_size, args.num_kv_heads, args.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_layers)]
        return cls(k, v, block_size)

    @property
    def scratch_block(self) -> int:
        return self.k[0].shape[0] - 1

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block ``src`` into ``dst`` in every layer."""
        if not pairs:
            return
        device = self.k[0].device
        src = to_device([p[0] for p in pairs], torch.int64, device)
        dst = to_device([p[1] for p in pairs], torch.int64, device)
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, dst, pool.index_select(0, src))


@dataclass(slots=True)
class StepInputs:
    """Per-step tensors shared by every layer. Tokens ``0..sparse rows-1`` are decode rows on
    an in-place path (sparse or paged); each ``DenseMeta`` covers a contiguous range of the
    remaining tokens."""

    input_ids: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat pool slots the new K/V go to
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor
    sparse: SparseMeta | PagedMeta | None = None
    dense: tuple[DenseMeta, ...] = ()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it (in float32), without the casts when already float32
    (then torch's fused kernel: one call instead of five, the same float32 arithmetic)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_tables(
    inv_freq: torch.Tensor, max_positions: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and the signed ``sin`` tables ``[max_positions, head_dim]``: with them RoPE is
    ``x * cos + x.roll(D/2) * sin`` (``roll`` swaps the halves; the sign of the first half is
    in the table), bit for bit transformers' ``x * cos + rotate_half(x) * sin``."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * scaling
    half = sin.shape[-1] // 2
    return emb.cos() * scaling, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        h = args.hidden_size
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Parameter(torch.empty(q_size + 2 * kv_size, h))
        self.qkv_bias = (
            nn.Parameter(torch.zeros(q_size + 2 * kv_size)) if args.attention_bias else None
        )
        self.o_proj = nn.Parameter(torch.empty(h, q_size))
        self.gate_up = nn.Parameter(torch.empty(2 * args.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, args.intermediate_size))
        # plain attributes: read per layer per step, cheaper than through ``args``
        self.scale = args.head_dim**-0.5
        self.eps = args.rms_norm_eps
        self.heads, self.kv_heads, self.dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.gqa = args.num_heads != args.num_kv_heads
        self.quant: dict[
            str, QuantPath
        ] = {}  # quantized twins of the matmuls (``attach_quantized``)
        self.build_kernels()

    def build_kernels(self) -> None:
        """(Re)build the matmuls from the current weights (packed copies on CPU). Where
        oneDNN runs them, gate and up are two matmuls again: silu fused into the gate's,
        the product into the up's (one pass over ``[T, intermediate]`` instead of four)."""
        quant = self.quant
        self.qkv_linear = Linear(self.qkv, self.qkv_bias, quant.get("qkv"))
        self.o_linear = Linear(self.o_proj, quant=quant.get("o"))
        self.down_linear = Linear(self.down, quant=quant.get("down"))
        gate, up = (
            Linear(w, quant=quant.get(name))
            for w, name in zip(self.gate_up.detach().chunk(2), ("gate", "up"), strict=True)
        )
        # Exactly one of the two is built: packing the fused weight as well would hold a
        # third copy of the MLP's weights that the split path never reads.
        self.gate_up_split: tuple[Linear, Linear] | None = (gate, up) if gate.packed else None
        self.gate_up_linear = None if gate.packed else Linear(self.gate_up)

    def forward(
        self, x: torch.Tensor, step: StepInputs, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        tokens, dim, heads, kv_heads = x.shape[0], self.dim, self.heads, self.kv_heads
        qk_size = self.q_size + self.kv_size
        h = _rms_norm(x, self.input_norm, self.eps)
        qkv = self.qkv_linear(h)
        # RoPE on q and k at once: [T, Hq + Hkv, D]
        qk = qkv[:, :qk_size].view(tokens, -1, dim)
        qk = qk * step.cos + qk.roll(dim // 2, -1) * step.sin
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, qk_size:].view(tokens, kv_heads, dim)
        k_pool.view(-1, kv_heads, dim).index_copy_(0, step.slot_mapping, k)
        v_pool.view(-1, kv_heads, dim).index_copy_(0, step.slot_mapping, v)
        sparse = step.sparse
        if sparse is not None and not step.dense:
            attn = pool_attention(q, k_pool, v_pool, sparse, self.scale)
        else:
            parts = []
            if sparse is not None:
                parts.append(
                    pool_attention(q[: sparse.num_rows], k_pool, v_pool, sparse, self.scale)
                )
            for meta in step.dense:
                q_part = q[meta.start : meta.start + meta.num_tokens]
                parts.append(dense_attention(q_part, k_pool, v_pool, meta, self.gqa))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = self.o_linear.plus(attn.reshape(tokens, self.q_size), x)
        h = _rms_norm(x, self.post_norm, self.eps)
        if self.gate_up_split is not None:
            gate_linear, up_linear = self.gate_up_split
            act = up_linear.times(h, gate_linear.silu(h))
        else:
            assert self.gate_up_linear is not None  # built whenever the split is not
            gate, up = self.gate_up_linear(h).chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_linear.plus(act, x)


class DecoderModel(nn.Module):
    """The decoder stack plus LM head; ``rope_cos``/``rope_sin`` (signed, see
    ``rope_tables``) are ``[max_len, head_dim]``."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs, inv_freq: torch.Tensor, rope_scaling: float) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self._layers = [self.layer(i) for i in range(args.num_layers)]
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = (
            None if args.tie_word_embeddings else nn.Parameter(torch.empty_like(self.embed))
        )
        self.head_quant: QuantPath | None = None  # the head's quantized twin (a GGUF's)
        self.head_linear = Linear(self.embed if self.lm_head is None else self.lm_head)
        cos, sin = rope_tables(inv_freq, args.max_position_embeddings, rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up."""

        def get(name: str) -> torch.Tensor:
            for key in (name, f"model.{name}"):
                if key in tensors:
                    return tensors[key]
            raise KeyError(f"missing weight {name!r}")

        with torch.no_grad():
            self.embed.copy_(get("embed_tokens.weight"))
            self.norm.copy_(get("norm.weight"))
            if self.lm_head is not None:
                self.lm_head.copy_(tensors["lm_head.weight"])
            for i in range(self.args.num_layers):
                layer = self.layer(i)
                p = f"layers.{i}."
                att = p + "self_attn."
                layer.input_norm.copy_(get(p + "input_layernorm.weight"))
                layer.post_norm.copy_(get(p + "post_attention_layernorm.weight"))
                qkv = [get(f"{att}{n}_proj.weight") for n in "qkv"]
                layer.qkv.copy_(torch.cat(qkv))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([get(f"{att}{n}_proj.bias") for n in "qkv"]))
                layer.o_proj.copy_(get(att + "o_proj.weight"))
                gate_up = [get(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
                layer.gate_up.copy_(torch.cat(gate_up))
                layer.down.copy_(get(p + "mlp.down_proj.weight"))
        self.build_kernels()

    def init_random(self, std: float, seed: int) -> None:
        """Random weights (throughput studies): normal(0, std), norms at 1."""
        gen = torch.Generator(device=self.embed.device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, std, generator=gen)
        self.build_kernels()

    def build_kernels(self) -> None:
        """Take the matmuls' packed weights from the current values (``linear.py``): done by
        ``load_hf_weights`` and ``init_random``; again after any other change of a weight or
        its device."""
        for layer in self._layers:
            layer.build_kernels()
        head = self.embed if self.lm_head is None else self.lm_head
        self.head_linear = Linear(head, quant=self.head_quant)

    def attach_quantized(
        self, weights: Mapping[str, Any], kernel: Any, max_rows: int, head_rows: int
    ) -> None:
        """Give every matmul whose weight ``weights`` holds (``gguf_weights.Q4Weight`` /
        ``Q8Weight`` by Hugging Face name) a quantized path for calls of at most
        ``max_rows`` rows (the LM head: ``head_rows``)."""
        for i, layer in enumerate(self._layers):
            p, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."

            def path(weight: Any) -> QuantPath:
                return QuantPath(weight, kernel, max_rows)

            names = [f"{att}{n}_proj.weight" for n in "qkv"]
            if all(n in weights for n in names):
                layer.quant["qkv"] = path(type(weights[names[0]]).cat([weights[n] for n in names]))
            for key, name in (("o", att + "o_proj.weight"), ("down", p + "mlp.down_proj.weight"),
                              ("gate", p + "mlp.gate_proj.weight"),
                              ("up", p + "mlp.up_proj.weight")):  # fmt: skip
                if name in weights:
                    layer.quant[key] = path(weights[name])
        head = weights.get("lm_head.weight" if self.lm_head is not None else
                           "model.embed_tokens.weight")  # fmt: skip
        self.head_quant = None if head is None else QuantPath(head, kernel, head_rows)
        self.build_kernels()

    def layer(self, index: int) -> DecoderLayer:
        layer = self.layers[index]
        assert isinstance(layer, DecoderLayer)  # internal: built that way in __init__
        return layer

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.embed.dtype
        cos = self.rope_cos[positions].to(dtype).unsqueeze(-2)
        sin = self.rope_sin[positions].to(dtype).unsqueeze(-2)
        return cos, sin

    def forward(self, step: StepInputs, cache: KVCache) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of every token of the step (before the final
        norm); ``logits`` turns the rows the caller needs into logits."""
        x = F.embedding(step.input_ids, self.embed)
        for layer, k_pool, v_pool in zip(self._layers, cache.k, cache.v, strict=True):
            x = layer.forward(x, step, k_pool, v_pool)  # no hooks: skip Module.__call__
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on selected rows only (``[..., hidden]``)."""
        h = _rms_norm(hidden, self.norm, self.args.rms_norm_eps)
        return self.head_linear(h).float()
