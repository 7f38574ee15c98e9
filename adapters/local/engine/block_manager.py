"""Paged KV block manager: reference counts, automatic prefix sharing, copy-on-write forks.

Full blocks are named by a chained hash (hash of the previous block's hash and this block's
tokens, as in vLLM / nano-vllm), so two sequences with the same token prefix map that prefix
to the same physical blocks, across requests and queries. A freed block keeps its hash and
stays findable until it is handed out again (LRU order), so a later request can still hit it.
A block's hash is published when the step that writes its K/V is planned (``publish``):
rows of the same step may share it, since every layer writes the step's K/V before it
attends. If that step fails, ``forget`` takes the hashes of the unwritten blocks back.
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

    def _match_prefix(self, seq: Sequence, max_cached: int) -> list[int]:
        """Cached blocks for the longest full-block prefix, leaving >= 1 token to compute
        and covering at most ``max_cached`` tokens."""
        if not self.enable_prefix_caching:
            return []
        bs, ids, hits = self.block_size, seq.token_ids, []
        limit = min(len(ids) - 1, max_cached)
        prev = -1
        for start in range(0, limit - limit % bs, bs):
            tokens = tuple(ids[start : start + bs])
            prev = chain_hash(prev, tokens)
            block_id = self._hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    # -- admission --------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, max_cached: int) -> int:
        total = -(-len(seq) // self.block_size)
        hits = self._match_prefix(seq, max_cached)
        return total - sum(1 for b in hits if self.blocks[b].ref_count > 0)

    def can_allocate(self, seq: Sequence, max_cached: int) -> bool:
        return self.num_blocks_needed(seq, max_cached) <= len(self._free)

    def allocate(self, seq: Sequence, max_cached: int) -> None:
        """Give a waiting sequence its block table; cached blocks are shared, not recomputed."""
        hits = self._match_prefix(seq, max_cached)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        fresh = -(-len(seq) // self.block_size) - len(hits)
        seq.block_table = hits + [self._pop_free() for _ in range(fresh)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        self.num_prefix_hit_blocks += len(hits)

    def publish(self, seq: Sequence, upto: int) -> None:
        """Publish the full blocks of ``seq`` that end at or before token ``upto``."""
        bs, table = self.block_size, seq.block_table
        if upto // bs <= seq.num_hashed_blocks:  # no block filled since the last publish
            return
        for index in range(seq.num_hashed_blocks, upto // bs):
            prev = self.blocks[table[index - 1]].hash if index else -1
            block = self.blocks[table[index]]
            if block.hash == -1:
                tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
                self._publish(block.block_id, prev, tokens)
            seq.num_hashed_blocks = index + 1

    def forget(self, seq: Sequence, start: int) -> None:
        """Un-publish the blocks of ``seq`` from token ``start`` on (their K/V were never
        written: the step that should have written them failed)."""
        bs = self.block_size
        for index in range(start // bs, seq.num_hashed_blocks):
            block = self.blocks[seq.block_table[index]]
            if block.hash != -1 and self._hash_to_block.get(block.hash) == block.block_id:
                del self._hash_to_block[block.hash]
            block.hash, block.token_ids = -1, ()
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, start // bs)

    # -- decode -----------------------------------------------------------------------------
    def reserve_slot(self, seq: Sequence) -> bool:
        """Room for the token at position len-1 (a new block, or a private copy of a shared
        partial one); False, changing nothing, when no block is free."""
        return self._writable(seq.block_table, (len(seq.token_ids) - 1) // self.block_size)

    def reserve_range(self, seq: Sequence, start: int, end: int) -> int:
        """Room for positions ``start .. end-1`` past the last token (a verify row's drafted
        tokens) from free blocks only, never evicting anyone. Returns the end reserved
        (``start`` when no block was to be had)."""
        bs, table = self.block_size, seq.block_table
        pos = start
        while pos < end:
            if not self._writable(table, pos // bs):
                return pos
            pos = (pos // bs + 1) * bs
        return end

    def _writable(self, table: list[int], index: int) -> bool:
        """Make block ``index`` of ``table`` exist and be private (copy-on-write of a shared
        one, a fresh block past the end); False, changing nothing, when no block is free."""
        if index < len(table):
            old = table[index]
            if self.blocks[old].ref_count == 1:
                return True
            if not self._free:
                return False
            new = self._pop_free()  # copy-on-write of a shared block
            self.cow_pairs.append((old, new))
            self._release(old)
            table[index] = new
            self.num_cow_copies += 1
            return True
        if not self._free:
            return False
        table.append(self._pop_free())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past those that hold positions ``0 .. num_tokens-1`` (a verify
        row's rejected drafts: their K/V is never read)."""
        keep = -(-num_tokens // self.block_size)
        table = seq.block_table
        while len(table) > keep:
            self._release(table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write at the next write)."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # tail first: evicted before the prefix
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_hashed_blocks = 0

    def take_cow_pairs(self) -> list[tuple[int, int]]:
        pairs, self.cow_pairs = self.cow_pairs, []
        return pairs
