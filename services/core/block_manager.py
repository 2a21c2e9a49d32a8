"""KV-cache block accounting for one worker: the scheduler's view of that worker's memory.

Signatures and docstrings are the contract the scheduler is written against; keep them.

Pure Python (no torch, no grpc). Block ids name slots in the worker's cache; the worker
never allocates (docs/ARCHITECTURE.md rule 2).

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
  A swapped-out sequence keeps its block hashes; swap_in re-registers its fresh blocks
  under them where no other block holds the hash.

Sequences
- A sequence is known from its first block (match_prefix hit, allocate_slots, fork) until
  free. Methods on an unknown id raise KeyError, except block_table ([]), free (no-op),
  and match_prefix / can_allocate / allocate_slots (a sequence holding no blocks yet).
- Misuse raises ValueError: a device-side method (match_prefix, cache_full_blocks,
  allocate_slots, fork) on a swapped-out sequence, swap_in on one that is not, swap_out /
  swap_in without room, match_prefix or a fork into a sequence that already holds blocks.
  The can_* queries answer False in those cases instead of raising.
"""
from __future__ import annotations

from collections import deque

from services.core.block_pool import ROOT_HASH, BlockPool, hash_block, hash_full_blocks
from services.core.kv_events import BlockStored, KVEventLog
from services.core.stats import BlockStats


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError("need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0; "
                             f"got {num_blocks}, {block_size}, {num_cpu_blocks}")
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks)
        self._free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))
        self._tables: dict[int, list[int]] = {}  # sequences on the device, each holding >= 1 block
        self._cpu_tables: dict[int, list[int]] = {}  # swapped-out sequences
        self._seq_hashes: dict[int, list[bytes]] = {}  # hashes of leading blocks already offered to the cache
        self._num_prefix_queries = 0
        self._num_prefix_hits = 0
        self.kv_events: KVEventLog | None = None  # record_events

    def record_events(self, log: KVEventLog) -> None:
        """Log the prefix cache's changes from now on (services/core/kv_events.py): a block cached
        under its hash (BlockStored), a cached block evicted (BlockRemoved)."""
        self.kv_events = self._pool.kv_events = log

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Device blocks with ref 0 (cached-but-free blocks count as free)."""
        return self._pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._free_cpu_blocks)

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use (ref > 0)."""
        return 1.0 - self._pool.num_free_blocks / self._pool.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's device block ids, in order ([] if it holds none)."""
        return list(self._tables.get(seq_id, []))

    def cpu_block_table(self, seq_id: int) -> list[int]:
        """The swapped-out sequence's CPU block ids, in order ([] if it is not swapped out)."""
        return list(self._cpu_tables.get(seq_id, []))

    def ref_count(self, block_id: int) -> int:
        """How many sequences' tables hold the device block."""
        return self._pool.blocks[block_id].ref_count

    def num_blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------
    def match_prefix(self, seq_id: int, token_ids: list[int], root: bytes = ROOT_HASH) -> int:
        """For a sequence that holds no blocks: attach the longest run of cached full blocks
        that match token_ids from the start (ref+1 each; taken out of the free pool if
        there) and return how many tokens they cover. Covers at most len(token_ids) - 1
        tokens (rounded down to a block multiple), so at least one token is always left to
        compute. Returns 0 when prefix caching is off. Counts a query of len(token_ids)
        tokens and the hit tokens in `stats`. root: the first block's parent hash (its adapter's)."""
        if self._held_blocks(seq_id):
            raise ValueError(f"match_prefix: sequence {seq_id} already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        # lookup: walk the hash chain until the first miss
        max_num_blocks = max(len(token_ids) - 1, 0) // self.block_size
        matched_ids: list[int] = []
        matched_hashes: list[bytes] = []
        for index in range(max_num_blocks):
            start = index * self.block_size
            parent_hash = matched_hashes[-1] if matched_hashes else root
            block_hash = hash_block(parent_hash, token_ids[start:start + self.block_size])
            block_id = self._pool.lookup(block_hash)
            if block_id is None:
                break
            self._pool.share(block_id)
            matched_ids.append(block_id)
            matched_hashes.append(block_hash)
        # attach
        if matched_ids:
            self._tables[seq_id] = matched_ids
            self._seq_hashes[seq_id] = matched_hashes
        num_hit_tokens = len(matched_ids) * self.block_size
        self._num_prefix_queries += len(token_ids)
        self._num_prefix_hits += num_hit_tokens
        return num_hit_tokens

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many of the leading full blocks with these chained hashes (hash_full_blocks) the cache
        holds; reads only (no reference taken, no stats counted): the scheduler's placement asks
        every worker before it picks one. 0 when prefix caching is off."""
        if not self.enable_prefix_caching:
            return 0
        for index, block_hash in enumerate(block_hashes):
            if self._pool.lookup(block_hash) is None:
                return index
        return len(block_hashes)

    def cached_block_hashes(self) -> set[bytes]:
        """The hashes the prefix cache holds now (what the KV events told a subscriber it holds)."""
        return set(self._pool.cached_block_ids())

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
                          root: bytes = ROOT_HASH, lora_id: int | None = None) -> None:
        """Register (hash) every block of the sequence that is full and entirely within the
        first num_computed_tokens tokens and not registered yet. No-op when caching is off.
        If an identical block is already registered under that hash, keep the existing
        registration (the sequence keeps its own block). lora_id: its adapter's, on the KV events."""
        table = self._device_table(seq_id)
        if not self.enable_prefix_caching:
            return
        num_full_blocks = min(min(num_computed_tokens, len(token_ids)) // self.block_size, len(table))
        known_hashes = self._seq_hashes.get(seq_id, [])
        if num_full_blocks <= len(known_hashes):
            return
        hashes = hash_full_blocks(token_ids, self.block_size, num_full_blocks, known_hashes, root)
        stored = [index for index in range(len(known_hashes), num_full_blocks)
                  if self._pool.register(table[index], hashes[index])]
        self._seq_hashes[seq_id] = hashes
        if self.kv_events is not None and stored:
            self._log_stored(hashes, token_ids, stored, lora_id)

    # ---- allocation ----------------------------------------------------------
    def can_allocate(self, seq_id: int, num_total_tokens: int) -> bool:
        """Whether allocate_slots(seq_id, num_total_tokens) would succeed."""
        if seq_id in self._cpu_tables:
            return False
        return self._num_new_blocks(seq_id, num_total_tokens) <= self._pool.num_free_blocks

    def allocate_slots(self, seq_id: int, num_total_tokens: int) -> list[int] | None:
        """Grow the sequence's table so it covers num_total_tokens slots. Returns the newly
        appended block ids ([] if none needed), or None and changes nothing when there
        are not enough free blocks."""
        num_new_blocks = self._num_new_blocks(seq_id, num_total_tokens)
        if num_new_blocks == 0:
            return []
        if num_new_blocks > self._pool.num_free_blocks:
            return None
        new_block_ids = self._pool.take(num_new_blocks)
        self._tables.setdefault(seq_id, []).extend(new_block_ids)
        return new_block_ids

    def trim(self, seq_id: int, num_total_tokens: int) -> int:
        """Give back the device blocks past those covering num_total_tokens slots (the slots of
        drafted tokens that were rejected), tail first; returns how many. Those blocks were
        allocated past the computed tokens, so none is shared or cached. ValueError if the
        sequence is swapped out."""
        table = self._device_table(seq_id)
        keep = max(self.num_blocks_needed(num_total_tokens), 1)
        dropped = table[keep:]
        if dropped:
            del table[keep:]
            self._pool.release(dropped[::-1])
        return len(dropped)

    def free(self, seq_id: int) -> None:
        """Release all the sequence's device blocks (ref-1; ref 0 -> free pool, tail first)
        and forget the sequence. Also releases CPU blocks if it is swapped out. No-op for
        an unknown sequence."""
        self._pool.release(self._tables.pop(seq_id, [])[::-1])
        self._free_cpu_blocks.extend(self._cpu_tables.pop(seq_id, []))
        self._seq_hashes.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give child_id a table sharing the parent's full blocks; copy a partial last block
        (the parent holds num_tokens tokens) into a fresh block. Returns the (src, dst)
        device copies the worker must do before its next forward, or None (nothing
        changed) if no block is free for the copy."""
        parent_table = self._device_table(parent_id)
        if self._held_blocks(child_id):
            raise ValueError(f"fork: child sequence {child_id} already holds blocks")
        if not 0 <= num_tokens <= len(parent_table) * self.block_size:
            raise ValueError(f"fork: parent {parent_id} holds {len(parent_table)} blocks, "
                             f"not enough for {num_tokens} tokens")
        num_full_blocks, num_partial_tokens = divmod(num_tokens, self.block_size)
        # copy-on-write of the partial last block, done now
        copies: list[tuple[int, int]] = []
        if num_partial_tokens:
            if self._pool.num_free_blocks == 0:
                return None
            copies.append((parent_table[num_full_blocks], self._pool.take(1)[0]))
        # share the full blocks
        child_table = parent_table[:num_full_blocks]
        for block_id in child_table:
            self._pool.share(block_id)
        child_table += [dst for _, dst in copies]
        if child_table:
            self._tables[child_id] = child_table
            self._seq_hashes[child_id] = self._seq_hashes.get(parent_id, [])[:num_full_blocks]
        return copies

    # ---- swap ----------------------------------------------------------------
    def can_swap_out(self, seq_id: int) -> bool:
        if self.is_swapped(seq_id):
            return False
        return len(self._tables[seq_id]) <= len(self._free_cpu_blocks)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence to CPU blocks: returns (device, cpu) copies; its device blocks
        are released (ref-1) and its table becomes a CPU table."""
        device_table = self._device_table(seq_id)
        if not self.can_swap_out(seq_id):
            raise ValueError(f"swap_out: sequence {seq_id} needs {len(device_table)} CPU blocks, "
                             f"{len(self._free_cpu_blocks)} free")
        cpu_table = [self._free_cpu_blocks.popleft() for _ in device_table]
        del self._tables[seq_id]
        self._cpu_tables[seq_id] = cpu_table
        self._pool.release(device_table[::-1])
        return list(zip(device_table, cpu_table))

    def can_swap_in(self, seq_id: int) -> bool:
        if not self.is_swapped(seq_id):
            return False
        return len(self._cpu_tables[seq_id]) <= self._pool.num_free_blocks

    def swap_in(self, seq_id: int, token_ids: list[int] = (), lora_id: int | None = None) -> list[tuple[int, int]]:
        """Move the sequence back: fresh device blocks; returns (cpu, device) copies; CPU
        blocks are freed. token_ids (the sequence's) and lora_id (its adapter's) name the
        re-registered blocks' tokens and adapter in the KV events, when they are on."""
        if not self.is_swapped(seq_id):
            raise ValueError(f"swap_in: sequence {seq_id} is not swapped out")
        cpu_table = self._cpu_tables[seq_id]
        if not self.can_swap_in(seq_id):
            raise ValueError(f"swap_in: sequence {seq_id} needs {len(cpu_table)} device blocks, "
                             f"{self._pool.num_free_blocks} free")
        device_table = self._pool.take(len(cpu_table))
        del self._cpu_tables[seq_id]
        self._free_cpu_blocks.extend(cpu_table)
        self._tables[seq_id] = device_table
        # the copied-back full blocks are cacheable again
        hashes = self._seq_hashes.get(seq_id, [])
        stored = [index for index, (block_id, block_hash) in enumerate(zip(device_table, hashes))
                  if self._pool.register(block_id, block_hash)]
        if self.kv_events is not None and stored:
            self._log_stored(hashes, list(token_ids), stored, lora_id)
        return list(zip(cpu_table, device_table))

    def is_swapped(self, seq_id: int) -> bool:
        self._check_known(seq_id)
        return seq_id in self._cpu_tables

    # ---- stats ---------------------------------------------------------------
    @property
    def stats(self) -> BlockStats:
        return BlockStats(num_gpu_blocks=self._pool.num_blocks, num_free_gpu_blocks=self.num_free_blocks,
                          num_cpu_blocks=self.num_cpu_blocks, num_free_cpu_blocks=self.num_free_cpu_blocks,
                          prefix_cache_queries=self._num_prefix_queries, prefix_cache_hits=self._num_prefix_hits)

    # ---- helpers -------------------------------------------------------------
    def _log_stored(self, hashes: list[bytes], token_ids: list[int], indices: list[int],
                    lora_id: int | None) -> None:
        """One BlockStored per run of consecutive newly cached blocks (indices into the sequence's
        blocks, ascending), each chained to the hash of the block before the run."""
        size = self.block_size
        start = 0
        for end in range(1, len(indices) + 1):
            if end < len(indices) and indices[end] == indices[end - 1] + 1:
                continue
            first, last = indices[start], indices[end - 1]
            self.kv_events.append(BlockStored(
                block_hashes=hashes[first:last + 1], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=token_ids[first * size:(last + 1) * size], block_size=size, lora_id=lora_id))
            start = end

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._tables and seq_id not in self._cpu_tables:
            raise KeyError(f"unknown sequence {seq_id}: it holds no blocks "
                           "(never allocated or already freed)")

    def _device_table(self, seq_id: int) -> list[int]:
        """The table of a known sequence on the device; ValueError if it is swapped out."""
        if self.is_swapped(seq_id):
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in first")
        return self._tables[seq_id]

    def _held_blocks(self, seq_id: int) -> list[int]:
        """The device table of a sequence that may hold no blocks yet; ValueError if swapped out."""
        if seq_id in self._cpu_tables:
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in first")
        return self._tables.get(seq_id, [])

    def _num_new_blocks(self, seq_id: int, num_total_tokens: int) -> int:
        return max(self.num_blocks_needed(num_total_tokens) - len(self._held_blocks(seq_id)), 0)
