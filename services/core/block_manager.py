"""KV-cache block accounting for one worker: the scheduler's view of that worker's memory.

INTERFACE STUB: a helper implements this file. Signatures and docstrings are the contract
the scheduler is written against; keep them.

Pure Python (no torch, no grpc). Block ids name slots in the worker's cache; the worker
never allocates (DESIGN rule 2).

Concepts
- A device block holds `block_size` token slots. Each has a reference count (how many
  sequences' tables hold it). ref 0 = free.
- Prefix caching (when enabled): a *full* block whose K/V have been computed is
  registered under a chained hash: hash(parent_block_hash, tuple(its token ids)) with
  sha256 (collision-safe). A freed block keeps its hash and content and sits in the free
  pool in LRU order (least recently freed first out); allocation takes from the head of
  the pool and evicts (unregisters) whatever hash the taken block had. A lookup that
  hits a free cached block takes it out of the pool (ref 0 -> 1). Blocks of a finished
  sequence are returned tail first, so its last blocks are evicted before its first.
- Fork (parallel samples): the child shares every full block of the parent (ref+1);
  a partial last block is copied at once into a fresh block for the child (copy-on-write
  done eagerly at fork time, so no sequence ever writes into a shared block).
- Swap: a CPU pool of `num_cpu_blocks`. swap_out copies a sequence's blocks to CPU blocks
  and releases its device blocks; swap_in allocates fresh device blocks and copies back.
"""
from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        ...

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Device blocks with ref 0 (cached-but-free blocks count as free)."""

    @property
    def num_free_cpu_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use (ref > 0)."""

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's device block ids, in order ([] if it holds none)."""

    def num_blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size)."""

    # ---- prefix cache --------------------------------------------------------
    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """For a sequence that holds no blocks: attach the longest run of cached full blocks
        that match token_ids from the start (ref+1 each; taken out of the free pool if
        there) and return how many tokens they cover. Covers at most len(token_ids) - 1
        tokens (rounded down to a block multiple), so at least one token is always left to
        compute. Returns 0 when prefix caching is off. Counts a query of len(token_ids)
        tokens and the hit tokens in `stats`."""

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register (hash) every block of the sequence that is full and entirely within the
        first num_computed_tokens tokens and not registered yet. No-op when caching is off.
        If an identical block is already registered under that hash, keep the existing
        registration (the sequence keeps its own block)."""

    # ---- allocation ----------------------------------------------------------
    def can_allocate(self, seq_id: int, num_total_tokens: int) -> bool:
        """Whether allocate_slots(seq_id, num_total_tokens) would succeed."""

    def allocate_slots(self, seq_id: int, num_total_tokens: int) -> list[int] | None:
        """Grow the sequence's table so it covers num_total_tokens slots. Returns the newly
        appended block ids ([] if none needed), or None and changes nothing when there
        are not enough free blocks."""

    def free(self, seq_id: int) -> None:
        """Release all the sequence's device blocks (ref-1; ref 0 -> free pool, tail first)
        and forget the sequence. Also releases CPU blocks if it is swapped out. No-op for
        an unknown sequence."""

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give child_id a table sharing the parent's full blocks; copy a partial last block
        (the parent holds num_tokens tokens) into a fresh block. Returns the (src, dst)
        device copies the worker must do before its next forward, or None (nothing
        changed) if no block is free for the copy."""

    # ---- swap ----------------------------------------------------------------
    def can_swap_out(self, seq_id: int) -> bool: ...

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence to CPU blocks: returns (device, cpu) copies; its device blocks
        are released (ref-1) and its table becomes a CPU table."""

    def can_swap_in(self, seq_id: int) -> bool: ...

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence back: fresh device blocks; returns (cpu, device) copies; CPU
        blocks are freed."""

    def is_swapped(self, seq_id: int) -> bool: ...

    # ---- stats ---------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """num_blocks, num_free_blocks, num_cpu_blocks, num_free_cpu_blocks,
        prefix_cache_queries (tokens looked up), prefix_cache_hits (tokens found)."""
