"""Device block pool: reference counts, the LRU free pool and the prefix-cache hash map.

The block manager decides which sequence holds which block; this module only keeps the
books for the blocks themselves. A free block keeps its hash (and the worker keeps its
K/V) until allocation takes it from the head of the free pool and evicts the hash.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from services.core.kv_events import BlockRemoved, KVEventLog

ROOT_HASH = b""  # parent hash of a sequence's first block (under the base model)


def root_hash(lora_name: str) -> bytes:
    """The parent hash of the first block of a sequence under this LoRA adapter ("": the base model), so
    that blocks computed under different weights never share a chain."""
    return ROOT_HASH if not lora_name else hashlib.sha256(b"lora\0" + lora_name.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained sha256 of one full block: (parent block hash, the block's token ids)."""
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(parent_hash + packed).digest()


def hash_full_blocks(token_ids: list[int], block_size: int, num_blocks: int,
                     known_hashes: list[bytes], root: bytes = ROOT_HASH) -> list[bytes]:
    """Chained hashes of the first num_blocks full blocks, reusing known_hashes (a prefix); root: the first
    block's parent (root_hash of the sequence's adapter)."""
    hashes = known_hashes[:num_blocks]
    for index in range(len(hashes), num_blocks):
        parent_hash = hashes[-1] if hashes else root
        hashes.append(hash_block(parent_hash, token_ids[index * block_size:(index + 1) * block_size]))
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while registered in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((block_id, None) for block_id in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.kv_events: KVEventLog | None = None  # evictions are logged here while KV events are on

    # ---- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids, next to be allocated first."""
        return list(self._free)

    def cached_block_ids(self) -> dict[bytes, int]:
        """A copy of the prefix-cache map: hash -> block id."""
        return dict(self._cached)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    # ---- reference counting --------------------------------------------------
    def take(self, num_blocks: int) -> list[int]:
        """Pop num_blocks from the head of the free pool (ref 0 -> 1), evicting their hashes.
        The caller checks num_free_blocks first."""
        assert num_blocks <= len(self._free), "take() past the free pool; check num_free_blocks first"
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.kv_events is not None:
                    self.kv_events.append(BlockRemoved([block.block_hash]))
                block.block_hash = None
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_id: int) -> None:
        """ref+1; a free (cached) block leaves the free pool."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """ref-1 each, in the given order; blocks reaching ref 0 join the tail of the pool."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released while free"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # ---- prefix cache --------------------------------------------------------
    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Register a held, unregistered block under block_hash, unless the hash is taken."""
        block = self.blocks[block_id]
        if block_hash in self._cached or block.block_hash is not None:
            return False
        self._cached[block_hash] = block_id
        block.block_hash = block_hash
        return True
