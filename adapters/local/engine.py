"""LLMEngine: add requests, abort by prefix, and ``step()`` = schedule -> run -> postprocess.

Not thread-safe: ``LocalBackend`` drives it from one worker thread. CD lives in
``_postprocess``: one forward per physical sequence, one draw per member, a fork only where
members drew different tokens (blocks shared, copy-on-write of the last partial block).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import torch

from spec_tot.errors import ConfigError
from spec_tot.requests import FinishReason, GenerateRequest, GenerateResult

from .block_manager import BlockManager
from .config import EngineConfig, resolve_device, resolve_dtype
from .detokenizer import decode_incremental, find_stop
from .loader import LoadedModel, build_random_model, load_model_folder
from .model import KVCache
from .runner import ModelRunner
from .sampler import Sampler, draw_uniforms
from .scheduler import Scheduler
from .sequence import (
    Member,
    RequestState,
    Sequence,
    SequenceStatus,
    finish_member,
    member_seed,
)
from .synthetic import PseudoTokenizer, synthetic_step_len

__all__ = ["LLMEngine"]

_COUNTERS = (
    "num_steps",
    "num_prefill_steps",
    "num_decode_steps",
    "num_requests",
    "num_merged_requests",
    "num_aborted_requests",
    "num_prompt_tokens",
    "num_computed_prompt_tokens",
    "num_generated_tokens",
    "num_forward_rows",
    "num_forks",
    "peak_kv_blocks_used",
    "step_seconds",
    "peak_running_seqs",
)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            if config.model is not None:
                loaded = load_model_folder(config.model, self.device, dtype)
            else:
                loaded = build_random_model(
                    config.model_config or {}, self.device, dtype, config.seed
                )
        self.loaded = loaded
        args = loaded.args
        self.tokenizer: Any = loaded.tokenizer or PseudoTokenizer(args.vocab_size)
        eos = set(args.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id or 0))
        self.eos_ids = frozenset(eos)
        bs = config.block_size
        self.max_len = min(
            config.max_model_len, args.max_position_embeddings, config.num_kv_blocks * bs
        )
        self.block_manager = BlockManager(config.num_kv_blocks, bs, config.enable_prefix_caching)
        cache = KVCache.allocate(args, config.num_kv_blocks, bs, self.device, dtype)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(loaded.model, cache, self.device)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self._merge_index: dict[tuple[Any, ...], Sequence] = {}
        self._seed_rng = random.Random(config.seed)
        self._next_seq_id = 0
        self._arrival = 0
        # counters (names listed in _COUNTERS; exported by ``stats()``)
        self.num_steps = self.num_prefill_steps = self.num_decode_steps = 0
        self.num_requests = self.num_merged_requests = self.num_aborted_requests = 0
        self.num_prompt_tokens = self.num_computed_prompt_tokens = 0
        self.num_generated_tokens = self.num_forward_rows = self.num_forks = 0
        self.peak_kv_blocks_used = self.peak_running_seqs = 0
        self.step_seconds = 0.0  # wall time inside step(): scheduling, forward, sampling

    # -- requests ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def add_request(self, request: GenerateRequest) -> None:
        if request.request_id in self.requests:
            raise ConfigError("request_id", f"{request.request_id!r} is already in flight")
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
        else:
            ids = self.encode(request.prompt or "")
        if not ids:
            raise ConfigError("prompt", "encodes to no token")
        if len(ids) >= self.max_len:
            raise ConfigError("prompt", f"{len(ids)} tokens; the engine holds {self.max_len}")
        params = request.sampling
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        state = RequestState(
            request.request_id, params, tuple(ids), request.priority, [None] * request.n
        )
        members = []
        for i in range(request.n):
            gen = None if params.greedy else torch.Generator().manual_seed(member_seed(seed, i))
            syn = self.config.synthetic
            target = synthetic_step_len(syn, request.request_id, i) if syn else 0
            members.append(Member(state, i, gen, target))
        self.requests[request.request_id] = state
        self.num_requests += 1
        self.num_prompt_tokens += len(ids)
        if not (self.config.enable_dedup and request.dedup):
            for member in members:
                self.scheduler.add(self._new_seq(ids, request, [member]))
            return
        key = (tuple(ids), dataclasses.replace(params, seed=None), request.priority)
        twin = self._merge_index.get(key)
        if (
            twin is not None
            and twin.status == SequenceStatus.WAITING
            and not twin.num_output_tokens
        ):
            twin.members.extend(members)  # CD across requests: one physical sequence
            self.num_merged_requests += 1
            return
        seq = self._new_seq(ids, request, members)
        if len(self._merge_index) > 2 * self.scheduler.num_waiting + 64:
            self._merge_index = {
                k: s for k, s in self._merge_index.items() if s.status == SequenceStatus.WAITING
            }
        self._merge_index[key] = seq
        self.scheduler.add(seq)

    def _new_seq(self, ids: list[int], request: GenerateRequest, members: list[Member]) -> Sequence:
        self._next_seq_id += 1
        self._arrival += 1
        return Sequence(
            self._next_seq_id,
            list(ids),
            len(ids),
            request.sampling,
            request.priority,
            self._arrival,
            members,
        )

    def abort(self, prefix: str) -> list[GenerateResult]:
        """Abort requests whose id is ``prefix`` or starts with ``prefix + "/"``; their blocks
        are freed now. Returns their (partial) results."""
        ids = {r for r in self.requests if r == prefix or r.startswith(prefix + "/")}
        return self._abort_ids(ids)

    def abort_all(self) -> list[GenerateResult]:
        return self._abort_ids(set(self.requests))

    def abort_request(self, request_id: str) -> list[GenerateResult]:
        return self._abort_ids({request_id} & self.requests.keys())

    def _abort_ids(self, ids: set[str]) -> list[GenerateResult]:
        if not ids:
            return []
        seqs = [*self.scheduler.running, *(s for q in self.scheduler.waiting.values() for s in q)]
        for seq in seqs:
            gone = [m for m in seq.members if m.request.request_id in ids]
            if not gone:
                continue
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            for member in gone:
                finish_member(member, text, seq.output_ids, FinishReason.ABORT)
            seq.members = [m for m in seq.members if m.request.request_id not in ids]
            if not seq.members:
                self._release(seq, SequenceStatus.ABORTED)
        self.num_aborted_requests += len(ids)
        return [self.requests.pop(rid).result() for rid in sorted(ids)]

    def _release(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = status

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[GenerateResult]:
        """One engine iteration; returns the requests that finished in it."""
        started = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        logits = self.runner.run(seqs, is_prefill, self.block_manager.take_cow_pairs())
        finished = self._postprocess(seqs, logits, is_prefill)
        self.step_seconds += time.perf_counter() - started
        return finished

    def _postprocess(
        self, seqs: list[Sequence], logits: torch.Tensor, is_prefill: bool
    ) -> list[GenerateResult]:
        bm = self.block_manager
        self.num_steps += 1
        self.num_prefill_steps += is_prefill
        self.num_decode_steps += not is_prefill
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, bm.num_used_blocks)
        self.peak_running_seqs = max(self.peak_running_seqs, len(self.scheduler.running))
        for seq in seqs:
            if is_prefill:
                self.num_computed_prompt_tokens += len(seq) - seq.num_computed_tokens
                for m in seq.members:
                    req = m.request
                    req.cached_prompt_tokens = max(req.cached_prompt_tokens, seq.num_cached_tokens)
            seq.num_computed_tokens = len(seq)
            bm.on_computed(seq)
        uniforms = [draw_uniforms([m.generator for m in s.members]) for s in seqs]
        tokens = self.sampler.sample(logits, [s.params for s in seqs], uniforms)
        self.num_forward_rows += len(seqs)
        finished: list[GenerateResult] = []
        for seq, toks in zip(seqs, tokens, strict=True):
            self.num_generated_tokens += len(toks)
            for child, tok in self._split(seq, toks):
                child.token_ids.append(tok)
                self._check_stop(child, tok, finished)
        return finished

    def _split(self, seq: Sequence, toks: list[int]) -> list[tuple[Sequence, int]]:
        """Group members by drawn token; the first group keeps ``seq``, others fork it."""
        first = toks[0]
        if all(t == first for t in toks):
            return [(seq, first)]
        groups: dict[int, list[Member]] = {}
        for member, tok in zip(seq.members, toks, strict=True):
            groups.setdefault(tok, []).append(member)
        out = []
        for i, (tok, members) in enumerate(groups.items()):
            if i == 0:
                seq.members = members
                out.append((seq, tok))
                continue
            self._next_seq_id += 1
            child = seq.fork(self._next_seq_id, members)
            self.block_manager.fork(seq, child)
            self.scheduler.add_running(child)
            self.num_forks += 1
            out.append((child, tok))
        return out

    def _check_stop(self, seq: Sequence, tok: int, finished: list[GenerateResult]) -> None:
        params, syn = seq.params, self.config.synthetic
        reason: FinishReason | None = None
        drop_last = False
        if syn is None and (tok in self.eos_ids or tok in params.stop_token_ids):
            reason, drop_last = FinishReason.STOP, True
        elif syn is None and params.stop:
            piece = decode_incremental(self.tokenizer, seq.output_ids, seq.detok)
            idx = find_stop(seq.detok.text, len(piece), params.stop) if piece else -1
            if idx != -1:
                seq.stop_text, reason = seq.detok.text[:idx], FinishReason.STOP
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_len
        ):
            reason = FinishReason.LENGTH
        if reason is None and syn is not None:
            done = [m for m in seq.members if m.target_len <= seq.num_output_tokens]
            if done and len(done) < len(seq.members):
                self._finish(seq, done, FinishReason.STOP, False, finished)
                seq.members = [m for m in seq.members if m.target_len > seq.num_output_tokens]
                return
            reason = FinishReason.STOP if done else None
        if reason is not None:
            self._finish(seq, seq.members, reason, drop_last, finished)
            self._release(seq, SequenceStatus.FINISHED)

    def _finish(
        self,
        seq: Sequence,
        members: list[Member],
        reason: FinishReason,
        drop_last: bool,
        finished: list[GenerateResult],
    ) -> None:
        out = seq.output_ids
        if seq.stop_text is not None:
            text = seq.stop_text
        else:
            text = self.tokenizer.decode(out[:-1] if drop_last else out, skip_special_tokens=True)
        for member in members:
            if finish_member(member, text, out, reason):
                finished.append(self.requests.pop(member.request.request_id).result())

    # -- counters ---------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        out = {name: float(getattr(self, name)) for name in _COUNTERS}
        out.update(
            peak_kv_blocks=float(self.peak_kv_blocks_used),
            num_total_blocks=float(bm.num_total_blocks),
            num_free_blocks=float(bm.num_free_blocks),
            num_prefix_hit_blocks=float(bm.num_prefix_hit_blocks),
            num_cached_prompt_tokens=float(bm.num_prefix_hit_blocks * bm.block_size),
            num_cow_copies=float(bm.num_cow_copies),
            num_preemptions=float(self.scheduler.num_preemptions),
            num_running=float(len(self.scheduler.running)),
            num_waiting=float(self.scheduler.num_waiting),
            num_dedup_saved_tokens=float(self.num_generated_tokens - self.num_forward_rows),
        )
        return out
