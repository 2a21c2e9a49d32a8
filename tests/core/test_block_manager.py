"""BlockManager: allocation, prefix caching, LRU eviction, fork, swap, and a stateful model check."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.core.block_manager import BlockManager

BLOCK_SIZE = 4


def run_sequence(manager: BlockManager, seq_id: int, token_ids: list[int]) -> int:
    """Admit a sequence the way the scheduler does: prefix match, allocate, compute, cache."""
    num_hit_tokens = manager.match_prefix(seq_id, token_ids)
    assert manager.allocate_slots(seq_id, len(token_ids)) is not None
    manager.cache_full_blocks(seq_id, token_ids, len(token_ids))
    return num_hit_tokens


# ---- allocation ----------------------------------------------------------------
def test_allocate_grows_table_by_blocks_needed():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = manager.allocate_slots(1, 5)
    assert len(first) == 2
    assert manager.allocate_slots(1, 8) == []
    third = manager.allocate_slots(1, 9)
    assert len(third) == 1
    assert manager.block_table(1) == first + third
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)
    assert manager.num_blocks_needed(9) == 3 and manager.num_blocks_needed(8) == 2


def test_allocate_when_full_returns_none_and_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    table = manager.allocate_slots(1, 12)
    assert not manager.can_allocate(2, 8)
    assert manager.allocate_slots(2, 8) is None
    assert manager.allocate_slots(1, 20) is None
    assert manager.block_table(1) == table
    assert manager.block_table(2) == []
    assert manager.num_free_blocks == 1
    assert manager.can_allocate(2, 4)


def test_free_returns_every_block_and_forgets_the_sequence():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    manager.allocate_slots(1, 10)
    manager.allocate_slots(2, 3)
    manager.free(1)
    manager.free(1)  # second free and unknown ids are no-ops
    manager.free(99)
    assert manager.block_table(1) == []
    assert manager.num_free_blocks == 5
    manager.free(2)
    assert manager.num_free_blocks == 6 and manager.usage == 0.0
    with pytest.raises(KeyError, match="unknown sequence 1"):
        manager.cache_full_blocks(1, [0] * 10, 10)


def test_unknown_sequence_ids():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    assert manager.block_table(7) == []
    assert manager.match_prefix(7, [1, 2, 3]) == 0
    assert manager.can_allocate(7, 4)
    for call in (lambda: manager.cache_full_blocks(7, [1], 1), lambda: manager.fork(7, 8, 0),
                 lambda: manager.swap_out(7), lambda: manager.swap_in(7), lambda: manager.is_swapped(7),
                 lambda: manager.can_swap_out(7), lambda: manager.can_swap_in(7)):
        with pytest.raises(KeyError, match="unknown sequence 7"):
            call()


# ---- prefix caching ------------------------------------------------------------
def test_prefix_hit_after_sequence_finished():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(10))
    run_sequence(manager, 1, prompt)
    finished_table = manager.block_table(1)
    manager.free(1)
    assert manager.num_free_blocks == 8  # cached blocks count as free

    assert manager.match_prefix(2, prompt + [50, 51]) == 8
    assert manager.block_table(2) == finished_table[:2]
    assert [manager.ref_count(b) for b in finished_table[:2]] == [1, 1]
    assert manager.num_free_blocks == 6
    assert manager.stats.prefix_cache_queries == 10 + 12
    assert manager.stats.prefix_cache_hits == 8


def test_prefix_hit_while_sequence_runs_shares_blocks():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    run_sequence(manager, 1, prompt)
    assert run_sequence(manager, 2, prompt) == 8
    shared = manager.block_table(1)[:2]
    assert manager.block_table(2)[:2] == shared
    assert manager.block_table(2)[2] != manager.block_table(1)[2]
    assert [manager.ref_count(b) for b in shared] == [2, 2]
    manager.free(1)
    assert [manager.ref_count(b) for b in shared] == [1, 1]
    assert manager.num_free_blocks == 8 - 3


def test_prefix_match_leaves_at_least_one_token():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(8))
    run_sequence(manager, 1, prompt)
    manager.free(1)
    assert manager.match_prefix(2, prompt) == 4
    assert manager.match_prefix(3, prompt[:4]) == 0
    assert manager.match_prefix(4, []) == 0


def test_only_full_computed_blocks_are_cached():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    manager.allocate_slots(1, 12)
    manager.cache_full_blocks(1, prompt, 7)  # one full block computed
    assert manager.match_prefix(2, prompt + [99]) == 4
    manager.cache_full_blocks(1, prompt, 12)
    assert manager.match_prefix(3, prompt + [99]) == 12


def test_hash_chaining_needs_the_same_prefix():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    block_a, block_b, block_c, block_d = [0] * 4, [1] * 4, [2] * 4, [3] * 4
    run_sequence(manager, 1, block_a + block_b)
    run_sequence(manager, 2, block_c + block_d)
    # block_b is cached, but after block_a: after block_c it is a miss
    assert manager.match_prefix(3, block_c + block_b + [9]) == 4
    assert manager.block_table(3) == manager.block_table(2)[:1]


def test_duplicate_block_keeps_existing_registration():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(5))
    run_sequence(manager, 1, prompt)
    manager.allocate_slots(2, 5)  # computed separately, no prefix match
    manager.cache_full_blocks(2, prompt, 5)
    first_block = manager.block_table(1)[0]
    manager.free(1)
    manager.free(2)
    assert manager.match_prefix(3, prompt) == 4
    assert manager.block_table(3) == [first_block]


def test_prefix_caching_off():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(9))
    run_sequence(manager, 1, prompt)
    manager.free(1)
    assert manager.match_prefix(2, prompt) == 0
    assert manager.block_table(2) == []


def test_lru_evicts_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    old, new = [1] * 8 + [0], [2] * 8 + [0]
    run_sequence(manager, 1, old[:8])
    run_sequence(manager, 2, new[:8])
    manager.free(1)
    manager.free(2)
    assert manager.allocate_slots(3, 8) == manager.block_table(3)  # takes old's two blocks
    assert manager.match_prefix(4, old) == 0
    assert manager.match_prefix(5, new) == 8


def test_lru_evicts_tail_blocks_before_head_blocks():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    run_sequence(manager, 1, prompt)
    head, middle, tail = manager.block_table(1)
    manager.free(1)
    assert manager.allocate_slots(2, 4) == [tail]
    assert manager.match_prefix(3, prompt) == 8
    assert manager.block_table(3) == [head, middle]


# ---- fork ----------------------------------------------------------------------
def test_fork_shares_full_blocks_and_copies_partial_one():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    parent = manager.allocate_slots(1, 10)
    copies = manager.fork(1, 2, 10)
    child = manager.block_table(2)
    assert len(copies) == 1 and copies[0][0] == parent[2]
    assert child == parent[:2] + [copies[0][1]]
    assert [manager.ref_count(b) for b in child] == [2, 2, 1]
    assert manager.fork(1, 3, 8) == []
    assert manager.block_table(3) == parent[:2]
    manager.free(1)
    assert [manager.ref_count(b) for b in parent] == [2, 2, 0]


def test_fork_without_free_block_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    parent = manager.allocate_slots(1, 10)
    assert manager.fork(1, 2, 10) is None
    assert manager.block_table(2) == []
    assert [manager.ref_count(b) for b in parent] == [1, 1, 1]


# ---- swap ----------------------------------------------------------------------
def test_swap_round_trip():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    device_table = manager.allocate_slots(1, 10)
    assert manager.can_swap_out(1) and not manager.can_swap_in(1)
    swap_out = manager.swap_out(1)
    assert [device for device, _ in swap_out] == device_table
    assert manager.is_swapped(1) and manager.block_table(1) == []
    assert manager.cpu_block_table(1) == [cpu for _, cpu in swap_out]
    assert manager.num_free_blocks == 6 and manager.num_free_cpu_blocks == 1
    with pytest.raises(ValueError, match="swapped out"):
        manager.allocate_slots(1, 20)

    swap_in = manager.swap_in(1)
    assert [cpu for cpu, _ in swap_in] == [cpu for _, cpu in swap_out]
    assert manager.block_table(1) == [device for _, device in swap_in]
    assert len(manager.block_table(1)) == 3
    assert manager.num_free_blocks == 3 and manager.num_free_cpu_blocks == 4
    assert not manager.is_swapped(1)


def test_swap_needs_room_and_free_releases_cpu_blocks():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE, num_cpu_blocks=2)
    manager.allocate_slots(1, 12)
    assert not manager.can_swap_out(1)
    with pytest.raises(ValueError, match="CPU blocks"):
        manager.swap_out(1)
    manager.allocate_slots(2, 8)
    manager.swap_out(2)
    assert manager.num_free_cpu_blocks == 0
    manager.allocate_slots(3, 12)
    assert not manager.can_swap_in(2)  # 0 device blocks free
    manager.free(2)
    assert manager.num_free_cpu_blocks == 2


def test_swap_in_restores_prefix_cache_entries():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE, num_cpu_blocks=3)
    prompt = list(range(9))
    run_sequence(manager, 1, prompt)
    manager.swap_out(1)
    manager.allocate_slots(2, 12)  # evicts every cached block
    manager.free(2)
    manager.swap_in(1)
    assert manager.match_prefix(3, prompt) == 8
    assert manager.block_table(3) == manager.block_table(1)[:2]


# ---- stateful model check ------------------------------------------------------
MODEL_BLOCK_SIZE = 2
TOKENS = st.lists(st.integers(0, 1), min_size=0, max_size=7)  # 2 symbols: prefixes collide often


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a small BlockManager like a scheduler would, with a model of each block's
    contents as the worker would hold them, and checks the books after every step."""

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(num_blocks=8, block_size=MODEL_BLOCK_SIZE, num_cpu_blocks=6)
        self.tokens: dict[int, list[int]] = {}  # seq id -> its token ids
        self.num_computed: dict[int, int] = {}
        self.device_content: dict[int, tuple[int, ...]] = {}  # what the worker's block holds
        self.cpu_content: dict[int, tuple[int, ...]] = {}
        self.num_queried_tokens = 0
        self.next_seq_id = 0

    # ---- helpers -------------------------------------------------------------
    def on_device(self) -> list[int]:
        return sorted(s for s in self.tokens if not self.manager.cpu_block_table(s))

    def swapped(self) -> list[int]:
        return sorted(s for s in self.tokens if self.manager.cpu_block_table(s))

    def holding(self) -> list[int]:
        return sorted(s for s in self.tokens if self.manager.block_table(s))

    def compute(self, seq_id: int) -> None:
        """The worker writes K/V for every uncomputed token; never into a shared block."""
        table, tokens = self.manager.block_table(seq_id), self.tokens[seq_id]
        first_block = self.num_computed[seq_id] // MODEL_BLOCK_SIZE
        for index in range(first_block, self.manager.num_blocks_needed(len(tokens))):
            assert self.manager.ref_count(table[index]) == 1, "write into a shared block"
            start = index * MODEL_BLOCK_SIZE
            self.device_content[table[index]] = tuple(tokens[start:start + MODEL_BLOCK_SIZE])
        self.num_computed[seq_id] = len(tokens)

    def admit(self, seq_id: int, tokens: list[int]) -> None:
        self.tokens[seq_id] = list(tokens)
        num_hit_tokens = self.manager.match_prefix(seq_id, tokens)
        self.num_queried_tokens += len(tokens)
        assert num_hit_tokens % MODEL_BLOCK_SIZE == 0
        assert num_hit_tokens <= max(len(tokens) - 1, 0)
        assert len(self.manager.block_table(seq_id)) == num_hit_tokens // MODEL_BLOCK_SIZE
        self.num_computed[seq_id] = num_hit_tokens
        if self.manager.allocate_slots(seq_id, len(tokens)) is not None:
            self.compute(seq_id)

    # ---- rules ---------------------------------------------------------------
    @rule(tokens=TOKENS, data=st.data())
    def add_sequence(self, tokens, data):
        if self.tokens and data.draw(st.booleans()):  # reuse a running prompt's prefix
            donor = data.draw(st.sampled_from(sorted(self.tokens)))
            tokens = self.tokens[donor][:data.draw(st.integers(0, 8))] + tokens
        self.admit(self.next_seq_id, tokens)
        self.next_seq_id += 1

    @precondition(lambda self: self.on_device())
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), max_size=3))
    def append(self, data, new_tokens):
        seq_id = data.draw(st.sampled_from(self.on_device()))
        table, num_free = self.manager.block_table(seq_id), self.manager.num_free_blocks
        num_total_tokens = len(self.tokens[seq_id]) + len(new_tokens)
        num_expected = max(self.manager.num_blocks_needed(num_total_tokens) - len(table), 0)
        assert self.manager.can_allocate(seq_id, num_total_tokens) == (num_expected <= num_free)
        new_blocks = self.manager.allocate_slots(seq_id, num_total_tokens)
        if new_blocks is None:
            assert num_expected > num_free
            assert self.manager.block_table(seq_id) == table and self.manager.num_free_blocks == num_free
            return
        assert len(new_blocks) == num_expected
        assert self.manager.block_table(seq_id) == table + new_blocks
        self.tokens[seq_id] += new_tokens
        self.compute(seq_id)

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def cache_full_blocks(self, data):
        seq_id = data.draw(st.sampled_from(self.holding()))
        num_tokens = data.draw(st.integers(0, self.num_computed[seq_id]))
        self.manager.cache_full_blocks(seq_id, self.tokens[seq_id], num_tokens)

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def fork(self, data):
        parent_id = data.draw(st.sampled_from(self.holding()))
        num_tokens = self.num_computed[parent_id]
        parent_table, num_free = self.manager.block_table(parent_id), self.manager.num_free_blocks
        copies = self.manager.fork(parent_id, self.next_seq_id, num_tokens)
        if copies is None:
            assert num_free == 0 and num_tokens % MODEL_BLOCK_SIZE
            assert self.manager.block_table(self.next_seq_id) == []
            return
        for src, dst in copies:
            assert src == parent_table[num_tokens // MODEL_BLOCK_SIZE]
            self.device_content[dst] = self.device_content[src]
        self.tokens[self.next_seq_id] = self.tokens[parent_id][:num_tokens]
        self.num_computed[self.next_seq_id] = num_tokens
        self.next_seq_id += 1

    @precondition(lambda self: self.on_device())
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def verify_drafts(self, data, drafts):
        """Speculative decoding: slots for drafted tokens after the last one, their K/V written by
        the verify pass; then the accepted drafts and the sampler's own token are the sequence's,
        and the blocks past its tokens (rejected drafts only) are given back."""
        seq_id = data.draw(st.sampled_from(self.on_device()))
        tokens, table = list(self.tokens[seq_id]), self.manager.block_table(seq_id)
        if self.manager.allocate_slots(seq_id, len(tokens) + len(drafts)) is None:
            return  # no room: the scheduler drafts nothing then
        self.tokens[seq_id] = tokens + drafts
        self.compute(seq_id)  # every drafted position is written, never into a shared block
        num_accepted = data.draw(st.integers(0, len(drafts)))
        self.tokens[seq_id] = tokens + drafts[:num_accepted] + [data.draw(st.integers(0, 1))]
        self.num_computed[seq_id] = len(tokens) + num_accepted
        grown = self.manager.block_table(seq_id)
        num_freed, num_free = self.manager.trim(seq_id, len(self.tokens[seq_id])), self.manager.num_free_blocks
        kept = self.manager.block_table(seq_id)
        assert kept == grown[:len(kept)] and kept[:len(table)] == table[:len(kept)]
        # all accepted: the sampler's token lies past the slots, and the next step's allocation grows the table
        assert len(kept) == min(len(grown), self.manager.num_blocks_needed(len(self.tokens[seq_id])))
        assert num_freed == len(grown) - len(kept)
        assert all(self.manager.ref_count(b) == 0 for b in grown[len(kept):])
        assert self.manager.trim(seq_id, len(self.tokens[seq_id])) == 0 and self.manager.num_free_blocks == num_free

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]
        assert self.manager.block_table(seq_id) == [] and self.manager.cpu_block_table(seq_id) == []

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def preempt(self, data):
        """Recompute preemption: free, then admit again with the same tokens."""
        seq_id = data.draw(st.sampled_from(self.holding()))
        tokens = self.tokens[seq_id]
        self.manager.free(seq_id)
        self.admit(seq_id, tokens)

    @precondition(lambda self: self.holding())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self.holding()))
        table = self.manager.block_table(seq_id)
        if not self.manager.can_swap_out(seq_id):
            assert len(table) > self.manager.num_free_cpu_blocks
            return
        copies = self.manager.swap_out(seq_id)
        assert [device for device, _ in copies] == table
        for device, cpu in copies:
            self.cpu_content[cpu] = self.device_content.get(device, ())

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(self.swapped()))
        cpu_table = self.manager.cpu_block_table(seq_id)
        if not self.manager.can_swap_in(seq_id):
            assert len(cpu_table) > self.manager.num_free_blocks
            return
        copies = self.manager.swap_in(seq_id)
        assert [cpu for cpu, _ in copies] == cpu_table
        assert len(self.manager.block_table(seq_id)) == len(cpu_table)
        for cpu, device in copies:
            self.device_content[device] = self.cpu_content[cpu]

    # ---- invariants ----------------------------------------------------------
    @invariant()
    def device_books_balance(self):
        pool = self.manager._pool
        tables = [self.manager.block_table(s) for s in self.tokens]
        holders: dict[int, int] = {}
        for table in tables:
            assert len(set(table)) == len(table), "a table holds a block twice"
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        free_ids = pool.free_block_ids()
        assert len(set(free_ids)) == len(free_ids)
        assert not set(free_ids) & set(holders), "a block is both free and in a table"
        assert len(free_ids) + len(holders) == pool.num_blocks == self.manager.stats.num_gpu_blocks
        assert self.manager.num_free_blocks == len(free_ids) == self.manager.stats.num_free_gpu_blocks
        for block in pool.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == holders.get(block.block_id, 0)

    @invariant()
    def cpu_books_balance(self):
        held = [b for s in self.tokens for b in self.manager.cpu_block_table(s)]
        assert len(set(held)) == len(held)
        assert self.manager.num_free_cpu_blocks + len(held) == self.manager.num_cpu_blocks
        for seq_id in self.swapped():
            assert self.manager.is_swapped(seq_id) and self.manager.block_table(seq_id) == []

    @invariant()
    def cache_map_matches_blocks(self):
        pool = self.manager._pool
        cached = pool.cached_block_ids()
        for block_hash, block_id in cached.items():
            assert pool.blocks[block_id].block_hash == block_hash
        assert sum(block.block_hash is not None for block in pool.blocks) == len(cached)

    @invariant()
    def computed_blocks_hold_the_sequence_tokens(self):
        """What a prefix hit, fork, swap or eviction leaves in a table is what the sequence wrote."""
        for seq_id in self.holding():
            table, tokens = self.manager.block_table(seq_id), self.tokens[seq_id]
            for index in range(self.manager.num_blocks_needed(self.num_computed[seq_id])):
                start = index * MODEL_BLOCK_SIZE
                expected = tuple(tokens[start:min(start + MODEL_BLOCK_SIZE, self.num_computed[seq_id])])
                assert self.device_content[table[index]][:len(expected)] == expected

    @invariant()
    def prefix_stats_count_queries(self):
        stats = self.manager.stats
        assert stats.prefix_cache_queries == self.num_queried_tokens
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries

    def teardown(self):
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        assert self.manager.num_free_blocks == self.manager.stats.num_gpu_blocks
        assert self.manager.num_free_cpu_blocks == self.manager.num_cpu_blocks
        assert all(block.ref_count == 0 for block in self.manager._pool.blocks)


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
