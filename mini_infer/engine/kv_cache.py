"""KVCacheManager: the block pool and each request's block table (bookkeeping only; the K/V tensors live with
the model runner), with automatic prefix caching.

A running request owns one row of a preallocated block-table tensor, so a step's block tables and slot mapping
are gathered from it with tensor ops instead of being rebuilt from Python lists.

Prefix caching: once a block is full, it is registered under a hash chained over its parent block's hash and its
token ids. A new request takes over the cached blocks of its longest cached prefix (reference-counted, shared
with whoever else holds them) and computes only the rest. A hit is checked, not trusted: the block must hold
exactly these token ids on top of exactly the block matched before it (its id and the epoch of its contents), so
a hash collision can never serve wrong K/V. A block nobody references is free; a free block keeps its contents
and stays findable until the pool needs it back, the least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks (nobody references them) in eviction order: least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._epoch = [0] * num_blocks  # bumped whenever a block is handed out for new contents
        self._hash: list[int | None] = [None] * num_blocks  # set while the block is registered in _cached
        self._key: list[tuple | None] = [None] * num_blocks  # (parent (block, epoch) or None, token ids)
        self._cached: dict[int, int] = {}  # hash -> block
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._num_owned: dict[str, int] = {}
        # request -> (hash, cached block holding the same contents) of each of its full blocks, in order; that
        # block is the request's own unless another request had already cached the very same contents.
        self._chains: dict[str, list[tuple[int, int]]] = {}
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int64)
        self.prefix_queries = 0  # prompt tokens looked up, over admitted requests
        self.prefix_hits = 0  # of those, tokens served from the cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached contents or not."""
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_owned(self, request_id: str) -> int:
        return self._num_owned.get(request_id, 0)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def free_blocks(self) -> list[int]:
        """The free blocks in eviction order."""
        return list(self._free)

    # ---- prefix caching ----

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest cached prefix of token_ids, whole blocks only and never all of
        token_ids (the last token is always computed, so that its logits exist). Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        size, hits = self.block_size, []
        parent_hash, parent = None, None
        for i in range((len(token_ids) - 1) // size):
            tokens = tuple(token_ids[i * size: (i + 1) * size])
            h = block_hash(parent_hash, tokens)
            block = self._cached.get(h)
            if block is None or self._key[block] != (parent, tokens):
                break
            hits.append(block)
            parent_hash, parent = h, (block, self._epoch[block])
        return hits

    def allocate_with_prefix(self, request_id: str, hits: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Admit a request that holds no blocks: take over `hits` (from match_prefix) and allocate the rest of
        `num_tokens` tokens, leaving at least `reserve` blocks free. False, and no change, if that does not fit."""
        assert request_id not in self._rows, request_id
        needed = self.blocks_for(num_tokens) - len(hits)
        free_hits = sum(1 for b in hits if self._ref[b] == 0)
        if (needed < 0 or needed + free_hits + reserve > len(self._free) or not self._free_rows
                or len(hits) + needed > self.max_blocks_per_seq):
            return False
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        self._chains[request_id] = [(self._hash[b], b) for b in hits]
        row = self._rows[request_id] = self._free_rows.pop()
        self._num_owned[request_id] = len(hits)
        if hits:
            self.block_tables[row, : len(hits)] = torch.tensor(hits)
        return self.allocate_slots(request_id, num_tokens)

    def count_prefix_query(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def cache_blocks(self, request_id: str, token_slice: Callable[[int, int], Sequence[int]],
                     num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens; token_slice(start, end) gives the
        request's token ids in [start, end)."""
        if not self.enable_prefix_caching or request_id not in self._rows:
            return
        chain = self._chains[request_id]
        row = self._rows[request_id]
        size = self.block_size
        for i in range(len(chain), num_computed_tokens // size):
            block = int(self.block_tables[row, i])
            tokens = tuple(token_slice(i * size, (i + 1) * size))
            parent_hash, parent = (chain[-1][0], (chain[-1][1], self._epoch[chain[-1][1]])) if chain else (None, None)
            h = block_hash(parent_hash, tokens)
            known = self._cached.get(h)
            if known is not None and self._key[known] == (parent, tokens):
                chain.append((h, known))  # computed twice (admitted together): the first copy stays the cached one
                continue
            if known is not None:  # a hash collision: the newer block takes the entry
                self._hash[known] = self._key[known] = None
            self._cached[h], self._hash[block], self._key[block] = block, h, (parent, tokens)
            chain.append((h, block))

    # ---- blocks ----

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens in all; False (and no change) if the pool
        cannot cover it."""
        owned = self._num_owned.get(request_id, 0)
        needed = self.blocks_for(num_tokens) - owned
        if needed <= 0:
            return True
        if needed > len(self._free) or owned + needed > self.max_blocks_per_seq:
            return False
        if request_id not in self._rows:
            if not self._free_rows:
                return False
            self._rows[request_id] = self._free_rows.pop()
            self._chains[request_id] = []
        row = self.block_tables[self._rows[request_id]]
        row[owned: owned + needed] = torch.tensor([self._take_free_block() for _ in range(needed)])
        self._num_owned[request_id] = owned + needed
        return True

    def _take_free_block(self) -> int:
        """The least recently freed block, its cached contents (if any) evicted."""
        block, _ = self._free.popitem(last=False)
        if self._hash[block] is not None:
            if self._cached.get(self._hash[block]) == block:
                del self._cached[self._hash[block]]
            self._hash[block] = self._key[block] = None
        self._epoch[block] += 1
        self._ref[block] = 1
        return block

    def free(self, request_id: str) -> None:
        """Drop the request's references (finish, abort, preemption); blocks nobody else holds become free, the
        request's last block first in eviction order."""
        row_index = self._rows.pop(request_id, None)
        owned = self._num_owned.pop(request_id, 0)
        self._chains.pop(request_id, None)
        if row_index is None:
            return
        for block in reversed(self.block_tables[row_index, :owned].tolist()):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        self._free_rows.append(row_index)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back the request's blocks past those holding `num_tokens` tokens (a verify step's rejected positions:
        never registered in the prefix cache, so they go first in eviction order); the blocks it keeps."""
        owned = self._num_owned.get(request_id, 0)
        keep = self.blocks_for(num_tokens)
        if owned <= keep:
            return owned
        row = self.block_tables[self._rows[request_id]]
        for block in row[keep:owned].tolist():
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)
        self._num_owned[request_id] = keep
        return keep

    def row(self, request_id: str) -> int:
        return self._rows[request_id]

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's blocks from the `start`-th on."""
        if request_id not in self._rows:
            return []
        return self.block_tables[self._rows[request_id], start: self._num_owned[request_id]].tolist()
