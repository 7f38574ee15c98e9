"""Accepting requests: validation, members and their generators, and engine-level CD.

``Intake.add`` turns a ``GenerateRequest`` into a ``RequestState`` with ``n`` members, each
with its own seeded generator, and queues physical sequences: one per member without CD, or
one for all members (and for identical pending requests: same prompt and sampling but the
seed) with it. A member's samples never depend on which sequence it shares.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from spec_tot.errors import ConfigError
from spec_tot.requests import GenerateRequest
from spec_tot.seeds import seed_mix

from ..config import EngineConfig
from .request_table import RequestTable
from .scheduler import Scheduler
from .sequence import Member, RequestState, Sequence, SequenceStatus
from .synthetic import synthetic_step_len
from .validate import RequestValidator

__all__ = ["Intake"]

_LIVE = (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Intake:
    def __init__(
        self,
        config: EngineConfig,
        validator: RequestValidator,
        scheduler: Scheduler,
        requests: RequestTable,
    ) -> None:
        self.config = config
        self.validator = validator
        self.scheduler = scheduler
        self.requests = requests
        self._merge_index: dict[tuple[Any, ...], Sequence] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrival = 0
        self.num_requests = self.num_merged_requests = self.num_prompt_tokens = 0

    def add(self, request: GenerateRequest, stream: bool) -> None:
        if request.request_id in self.requests:
            raise ConfigError("request_id", f"{request.request_id!r} is already in flight")
        ids = self.validator.prompt_ids(request)
        params = request.sampling
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        state = RequestState(
            request.request_id,
            params,
            tuple(ids),
            request.priority,
            [None] * request.n,
            stream=stream,
            prompt_logprobs_from=request.prompt_logprobs_from,
        )
        syn = self.config.synthetic
        members = []
        for i in range(request.n):
            gen = None if params.greedy else torch.Generator().manual_seed(seed_mix(seed, i))
            target = synthetic_step_len(syn, request.request_id, i) if syn else 0
            members.append(Member(state, i, gen, target))
        self.requests.add(request.request_id, state)
        self.num_requests += 1
        self.num_prompt_tokens += len(ids)
        if not (self.config.enable_dedup and request.dedup):
            for member in members:
                self.scheduler.add(self._new_seq(ids, request, [member]))
            return
        key = (
            tuple(ids),
            dataclasses.replace(params, seed=None),
            request.priority,
            request.prompt_logprobs_from,
        )
        twin = self._merge_index.get(key)
        if twin is not None and twin.status in _LIVE and not twin.num_output_tokens:
            twin.members.extend(members)  # CD across requests: one physical sequence
            twin.streaming = twin.streaming or stream
            self.num_merged_requests += 1
            return
        seq = self._new_seq(ids, request, members)
        live = self.scheduler.num_waiting + len(self.scheduler.running)
        if len(self._merge_index) > 2 * live + 64:
            self._merge_index = {
                k: s
                for k, s in self._merge_index.items()
                if s.status in _LIVE and not s.num_output_tokens
            }
        self._merge_index[key] = seq
        self.scheduler.add(seq)

    def _new_seq(self, ids: list[int], request: GenerateRequest, members: list[Member]) -> Sequence:
        self._arrival += 1
        return Sequence(
            self.requests.next_seq_id(),
            list(ids),
            len(ids),
            request.sampling,
            request.priority,
            self._arrival,
            members,
            prompt_logprobs_from=request.prompt_logprobs_from,
            streaming=any(m.request.stream for m in members),
        )
