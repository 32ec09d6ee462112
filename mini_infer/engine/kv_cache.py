"""KVCacheManager: the block pool and each request's block table (bookkeeping only; the K/V tensors
live with the model runner).

A running request owns one row of a preallocated block-table tensor, so a step's block tables and slot
mapping are gathered from it with tensor ops instead of being rebuilt from Python lists.
"""

from __future__ import annotations

from collections import deque

import torch


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._num_owned: dict[str, int] = {}
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int64)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def usage(self) -> float:
        """Fraction of blocks owned by requests."""
        return (self.num_blocks - len(self._free_blocks)) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_owned(self, request_id: str) -> int:
        return self._num_owned.get(request_id, 0)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens in all; False (and no change) if the pool
        cannot cover it."""
        owned = self._num_owned.get(request_id, 0)
        needed = self.blocks_for(num_tokens) - owned
        if needed <= 0:
            return True
        if needed > len(self._free_blocks) or owned + needed > self.max_blocks_per_seq:
            return False
        if request_id not in self._rows:
            if not self._free_rows:
                return False
            self._rows[request_id] = self._free_rows.pop()
        row = self.block_tables[self._rows[request_id]]
        row[owned: owned + needed] = torch.tensor([self._free_blocks.popleft() for _ in range(needed)])
        self._num_owned[request_id] = owned + needed
        return True

    def free(self, request_id: str) -> None:
        """Give every block of the request back to the pool (finish, abort, preemption)."""
        row_index = self._rows.pop(request_id, None)
        owned = self._num_owned.pop(request_id, 0)
        if row_index is None:
            return
        self._free_blocks.extend(self.block_tables[row_index, :owned].tolist())
        self._free_rows.append(row_index)

    def row(self, request_id: str) -> int:
        return self._rows[request_id]

    def block_ids(self, request_id: str) -> list[int]:
        if request_id not in self._rows:
            return []
        return self.block_tables[self._rows[request_id], : self._num_owned[request_id]].tolist()
