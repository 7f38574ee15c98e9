"""Paged KV block manager: reference counts, automatic prefix sharing, copy-on-write forks.

Full blocks are named by a chained hash (hash of the previous block's hash and this block's
tokens, as in vLLM / nano-vllm), so two sequences with the same token prefix map that prefix
to the same physical blocks, across requests and queries. A freed block keeps its hash and
stays findable until it is handed out again (LRU order), so a later request can still hit it.
A block's hash is published only once its K/V are written (prompt blocks: in the step that
allocates them; generated blocks: after the forward that fills them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence

__all__ = ["Block", "BlockManager", "chain_hash"]


def chain_hash(prev: int, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = -1
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.cow_pairs: list[tuple[int, int]] = []  # (src, dst) copies for the next forward
        self.num_prefix_hit_blocks = 0
        self.num_cow_copies = 0

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (SGLang's ``/flush_cache``); only when no block is in
        use, as SGLang flushes only while idle. Returns whether it did."""
        if self.num_used_blocks:
            return False
        self._hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, ()
        return True

    # -- internals --------------------------------------------------------------------------
    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash != -1 and self._hash_to_block.get(block.hash) == block_id:
            del self._hash_to_block[block.hash]  # evicted from the prefix cache
        block.hash, block.token_ids, block.ref_count = -1, (), 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _publish(self, block_id: int, prev_hash: int, tokens: tuple[int, ...]) -> int:
        block = self.blocks[block_id]
        block.hash, block.token_ids = chain_hash(prev_hash, tokens), tokens
        if self.enable_prefix_caching:
            self._hash_to_block.setdefault(block.hash, block_id)
        return block.hash

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest full-block prefix, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs, ids, hits = self.block_size, seq.token_ids, []
        prev = -1
        for start in range(0, len(ids) - 1 - (len(ids) - 1) % bs, bs):
            tokens = tuple(ids[start : start + bs])
            prev = chain_hash(prev, tokens)
            block_id = self._hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    # -- admission --------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence) -> int:
        total = -(-len(seq) // self.block_size)
        in_use = sum(1 for b in self._match_prefix(seq) if self.blocks[b].ref_count > 0)
        return total - in_use

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_blocks_needed(seq) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence its block table; cached blocks are shared, not recomputed."""
        hits = self._match_prefix(seq)
        bs, ids, prev = self.block_size, seq.token_ids, -1
        table: list[int] = []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
            prev = block.hash
        for start in range(len(hits) * bs, len(ids), bs):
            block_id = self._pop_free()
            table.append(block_id)
            tokens = tuple(ids[start : start + bs])
            if len(tokens) == bs:  # computed in this very step, before anyone can read it
                prev = self._publish(block_id, prev, tokens)
        seq.block_table = table
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * bs
        self.num_prefix_hit_blocks += len(hits)

    # -- decode -----------------------------------------------------------------------------
    def _needs_block(self, seq: Sequence) -> bool:
        """The token at position len-1 is written next step: a new block or a private copy."""
        pos = len(seq) - 1
        if pos // self.block_size >= len(seq.block_table):
            return True
        return self.blocks[seq.block_table[pos // self.block_size]].ref_count > 1

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or len(self._free) > 0

    def may_append(self, seq: Sequence) -> None:
        pos = len(seq) - 1
        index = pos // self.block_size
        if index >= len(seq.block_table):
            seq.block_table.append(self._pop_free())
            return
        old = seq.block_table[index]
        if self.blocks[old].ref_count > 1:  # copy-on-write of a shared partial block
            new = self._pop_free()
            self.cow_pairs.append((old, new))
            self._release(old)
            seq.block_table[index] = new
            self.num_cow_copies += 1

    def on_computed(self, seq: Sequence) -> None:
        """After a forward: publish the block the sequence just filled, if it is full."""
        n = seq.num_computed_tokens
        if n % self.block_size or n == 0:
            return
        index = n // self.block_size - 1
        block = self.blocks[seq.block_table[index]]
        if block.hash != -1:
            return
        prev = self.blocks[seq.block_table[index - 1]].hash if index else -1
        self._publish(block.block_id, prev, tuple(seq.token_ids[n - self.block_size : n]))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write at the next write)."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # tail first: evicted before the prefix
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def take_cow_pairs(self) -> list[tuple[int, int]]:
        pairs, self.cow_pairs = self.cow_pairs, []
        return pairs
