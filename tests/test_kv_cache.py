"""KVCacheManager: exact block ids and block-table rows, and a hypothesis state machine that drives random
allocate / append / free / preempt sequences over a small pool and checks the bookkeeping after every step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_infer.engine.kv_cache import KVCacheManager


def snapshot(kv: KVCacheManager, request_ids) -> tuple:
    return (kv.num_free_blocks, kv.usage(), {rid: kv.block_ids(rid) for rid in request_ids},
            kv.block_tables.clone())


# ---- exact unit tests ----

def test_fresh_pool_is_empty():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_num_seqs=2, max_blocks_per_seq=8)
    assert kv.num_free_blocks == 8
    assert kv.usage() == 0.0
    assert kv.block_ids("nobody") == []
    assert kv.num_blocks_owned("nobody") == 0
    assert [kv.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_block_ids_handed_out_in_order_and_rows_list_them():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_num_seqs=2, max_blocks_per_seq=8)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert kv.allocate_slots("b", 4)  # 1 block
    assert kv.block_ids("a") == [0, 1]
    assert kv.block_ids("b") == [2]
    assert kv.block_tables[kv.row("a"), :2].tolist() == [0, 1]
    assert kv.block_tables[kv.row("b"), :1].tolist() == [2]
    assert kv.row("a") != kv.row("b")
    assert kv.num_free_blocks == 5
    assert kv.usage() == pytest.approx(3 / 8)


def test_growing_adds_blocks_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_num_seqs=2, max_blocks_per_seq=8)
    assert kv.allocate_slots("a", 1)
    assert kv.block_ids("a") == [0]
    for num_tokens in (2, 3, 4):
        assert kv.allocate_slots("a", num_tokens)
        assert kv.block_ids("a") == [0]
    assert kv.allocate_slots("b", 1)
    assert kv.allocate_slots("a", 5)
    assert kv.block_ids("a") == [0, 2]  # the next free block, not necessarily contiguous
    assert kv.block_tables[kv.row("a"), :2].tolist() == [0, 2]
    assert kv.allocate_slots("a", 3)  # shrinking the request is a no-op
    assert kv.block_ids("a") == [0, 2]
    assert kv.num_free_blocks == 5


def test_free_returns_blocks_and_they_are_reused():
    kv = KVCacheManager(num_blocks=4, block_size=2, max_num_seqs=3, max_blocks_per_seq=4)
    assert kv.allocate_slots("a", 3)  # [0, 1]
    assert kv.allocate_slots("b", 2)  # [2]
    kv.free("a")
    assert kv.num_free_blocks == 3
    assert kv.block_ids("a") == []
    assert kv.num_blocks_owned("a") == 0
    assert kv.block_ids("b") == [2]
    assert kv.allocate_slots("c", 6)  # every free block: 3, then a's 0 and 1
    assert sorted(kv.block_ids("c")) == [0, 1, 3]
    assert kv.num_free_blocks == 0
    assert kv.usage() == 1.0
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 4
    assert kv.usage() == 0.0


def test_free_of_unknown_or_already_freed_request_is_a_no_op():
    kv = KVCacheManager(num_blocks=4, block_size=2, max_num_seqs=2, max_blocks_per_seq=4)
    assert kv.allocate_slots("a", 2)
    kv.free("ghost")
    kv.free("a")
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.allocate_slots("b", 8) and kv.allocate_slots("c", 0)
    assert kv.num_free_blocks == 0


def test_allocate_beyond_pool_fails_without_partial_allocation():
    kv = KVCacheManager(num_blocks=4, block_size=4, max_num_seqs=3, max_blocks_per_seq=8)
    assert kv.allocate_slots("a", 8)  # 2 blocks
    before = snapshot(kv, ["a", "b"])
    assert not kv.allocate_slots("b", 12)  # needs 3, 2 free
    assert not kv.allocate_slots("a", 20)  # grow by 3, 2 free
    after = snapshot(kv, ["a", "b"])
    assert after[:3] == before[:3]
    assert torch.equal(after[3], before[3])
    # The failed newcomer took no row: a third request still gets one, and then all rows are used.
    assert kv.allocate_slots("b", 4) and kv.allocate_slots("c", 4)
    assert kv.num_free_blocks == 0


def test_allocate_beyond_max_blocks_per_seq_fails_even_with_free_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, max_num_seqs=2, max_blocks_per_seq=3)
    assert not kv.allocate_slots("a", 13)  # 4 blocks > 3
    assert kv.num_free_blocks == 16 and kv.block_ids("a") == []
    assert kv.allocate_slots("a", 12)
    assert not kv.allocate_slots("a", 13)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 13


def test_allocate_fails_when_every_row_is_taken():
    kv = KVCacheManager(num_blocks=16, block_size=4, max_num_seqs=2, max_blocks_per_seq=4)
    assert kv.allocate_slots("a", 1) and kv.allocate_slots("b", 1)
    assert not kv.allocate_slots("c", 1)
    assert kv.num_free_blocks == 14 and kv.block_ids("c") == []
    kv.free("a")
    assert kv.allocate_slots("c", 1)


def test_rows_reused_after_free():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_num_seqs=2, max_blocks_per_seq=4)
    assert kv.allocate_slots("a", 4) and kv.allocate_slots("b", 4)
    assert {kv.row("a"), kv.row("b")} == {0, 1}
    row_a = kv.row("a")
    kv.free("a")
    with pytest.raises(KeyError):
        kv.row("a")
    assert kv.allocate_slots("c", 8)
    assert kv.row("c") == row_a
    assert kv.block_tables[row_a, :2].tolist() == kv.block_ids("c")
    assert set(kv.block_ids("c")).isdisjoint(kv.block_ids("b"))


# ---- property-based: random operation sequences over a small pool ----

class KVCacheMachine(RuleBasedStateMachine):
    """A reference model (tokens per request, admission order) next to the real manager."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), max_num_seqs=st.integers(1, 5),
                max_blocks_per_seq=st.integers(1, 8))
    def setup(self, num_blocks, block_size, max_num_seqs, max_blocks_per_seq):
        self.kv = KVCacheManager(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)
        self.max_num_seqs = max_num_seqs
        self.tokens: dict[str, int] = {}  # every request that holds a row, in admission order
        self.next_id = 0

    def _blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.kv.block_size)

    def _expect_allocate(self, request_id: str, num_tokens: int) -> bool:
        owned = self._blocks(self.tokens.get(request_id, 0))
        needed = self._blocks(num_tokens) - owned
        if needed <= 0:
            return True
        has_row = request_id in self.tokens or len(self.tokens) < self.max_num_seqs
        return has_row and needed <= self.kv.num_free_blocks and owned + needed <= self.kv.max_blocks_per_seq

    def _allocate(self, request_id: str, num_tokens: int) -> None:
        expected = self._expect_allocate(request_id, num_tokens)
        free_before = set(self._free_set())
        owned_before = self.kv.block_ids(request_id)
        before = snapshot(self.kv, self.tokens)
        assert self.kv.allocate_slots(request_id, num_tokens) is expected
        if not expected:
            after = snapshot(self.kv, self.tokens)
            assert after[:3] == before[:3] and torch.equal(after[3], before[3])
            assert self.kv.block_ids(request_id) == owned_before
            return
        self.tokens[request_id] = max(num_tokens, self.tokens.get(request_id, 0))
        owned_after = self.kv.block_ids(request_id)
        assert owned_after[:len(owned_before)] == owned_before  # growing keeps the blocks it had, in order
        assert set(owned_after[len(owned_before):]) <= free_before  # and takes only free ones

    def _free_set(self) -> list[int]:
        owned = {b for rid in self.tokens for b in self.kv.block_ids(rid)}
        return [b for b in range(self.kv.num_blocks) if b not in owned]

    @rule(num_tokens=st.integers(1, 40))
    def allocate(self, num_tokens):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self._allocate(request_id, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 99), grow=st.integers(0, 12))
    def append(self, pick, grow):
        request_id = list(self.tokens)[pick % len(self.tokens)]
        self._allocate(request_id, self.tokens[request_id] + grow)

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 99))
    def free(self, pick):
        request_id = list(self.tokens)[pick % len(self.tokens)]
        freed = self.kv.block_ids(request_id)
        free_before = self.kv.num_free_blocks
        self.kv.free(request_id)
        del self.tokens[request_id]
        assert self.kv.num_free_blocks == free_before + len(freed)
        assert self.kv.block_ids(request_id) == []

    @precondition(lambda self: self.tokens)
    @rule()
    def preempt(self):
        self.free(len(self.tokens) - 1)  # the most recently admitted one

    @rule()
    def free_unknown(self):
        before = snapshot(self.kv, self.tokens)
        self.kv.free("never-allocated")
        assert snapshot(self.kv, self.tokens)[:3] == before[:3]

    @invariant()
    def bookkeeping_is_consistent(self):
        kv = self.kv
        owned = {rid: kv.block_ids(rid) for rid in self.tokens}
        all_owned = [b for ids in owned.values() for b in ids]
        assert len(all_owned) == len(set(all_owned)), "a block is owned by two requests"
        assert all(0 <= b < kv.num_blocks for b in all_owned)
        free = kv.free_blocks()
        assert len(free) == len(set(free)), "a block is free twice"
        assert set(free).isdisjoint(all_owned), "a block is both free and owned"
        assert len(free) + len(all_owned) == kv.num_blocks
        assert kv.num_free_blocks == len(free)
        assert kv.usage() == pytest.approx(len(all_owned) / kv.num_blocks, abs=1e-12)
        rows = [kv.row(rid) for rid in self.tokens]
        assert len(rows) == len(set(rows)), "two requests share a block-table row"
        for rid, ids in owned.items():
            assert len(ids) == self._blocks(self.tokens[rid]) == kv.num_blocks_owned(rid)
            assert kv.block_tables[kv.row(rid), :len(ids)].tolist() == ids

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in list(self.tokens):
            self.kv.free(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.usage() == 0.0
        assert sorted(self.kv.free_blocks()) == list(range(self.kv.num_blocks))


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
