"""The worker's paged KV cache and its CPU swap pool. Block ids come from the scheduler.

On CUDA the swap pool is pinned host memory and swaps run as asynchronous block copies on two
copy streams (device -> host, host -> device). Each copy stream first waits for the work queued on
the compute stream (the last kernels that wrote or read the blocks), and the compute stream waits
for the copies before the step's kernels: the scheduler may hand a block freed by a swap-out to
another sequence in the same step. So the host thread never blocks on a swap, and the copies run
on the copy engines, but they do not overlap the step's own kernels (that would need the scheduler
to keep swapped blocks out of the step).
"""
from __future__ import annotations

import torch

from services.worker.model_config import ModelArchConfig

DEFAULT_CPU_KV_BYTES = 1 << 30  # KV cache budget on the CPU when none is configured
CUDA_MEMORY_FRACTION = 0.85  # of the memory left after the weights, on CUDA


def block_bytes(cfg: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def num_blocks_for(cfg: ModelArchConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   num_blocks: int | None, memory_bytes: int | None) -> int:
    if num_blocks is not None:
        return num_blocks
    if memory_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory_bytes = int(free * CUDA_MEMORY_FRACTION)
        else:
            memory_bytes = DEFAULT_CPU_KV_BYTES
    return max(1, memory_bytes // block_bytes(cfg, block_size, dtype))


class KVCache:
    def __init__(self, cfg: ModelArchConfig, num_blocks: int, num_cpu_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, allocate: bool = True):
        """allocate False: the block ids without memory behind them (an encoder, which writes and reads no KV:
        its blocks are the scheduler's admission count only), and no swap pool."""
        num_layers = cfg.num_layers if allocate else 0
        num_cpu_blocks = num_cpu_blocks if allocate else 0
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        cpu_shape = (num_cpu_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.block_size, self.num_blocks, self.num_cpu_blocks = block_size, num_blocks, num_cpu_blocks
        # [num_blocks, block_size, KVH, D] per layer, K and V
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]
        on_gpu = device.type == "cuda"
        self.cpu_layers = [(torch.zeros(cpu_shape, dtype=dtype, pin_memory=on_gpu),
                            torch.zeros(cpu_shape, dtype=dtype, pin_memory=on_gpu)) for _ in range(num_layers)]
        # (swap-out, swap-in) copy streams on CUDA, when there is a swap space
        self.copy_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if on_gpu and num_cpu_blocks else None

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:  # (device block, cpu block)
        if self.copy_streams is None:
            self._move(pairs, self.layers, self.cpu_layers)
        else:
            self._copy_on(self.copy_streams[0], pairs, self.layers, self.cpu_layers)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:  # (cpu block, device block)
        if self.copy_streams is None:
            self._move(pairs, self.cpu_layers, self.layers)
        else:
            self._copy_on(self.copy_streams[1], pairs, self.cpu_layers, self.layers)

    def copy(self, pairs: list[tuple[int, int]]) -> None:  # (src, dst) device blocks
        self._move(pairs, self.layers, self.layers)

    @staticmethod
    def _copy_on(stream, pairs, sources, targets) -> None:
        """Bit-exact block copies between the device and the pinned pool, all layers, queued on `stream`
        after the compute stream's work so far; the compute stream then waits for them."""
        if not pairs:
            return
        compute = torch.cuda.current_stream(stream.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for source_layer, target_layer in zip(sources, targets):
                for source, target in zip(source_layer, target_layer):  # K, then V
                    for src, dst in pairs:  # [block_size, KVH, D], contiguous on both sides
                        target[dst].copy_(source[src], non_blocking=True)
        compute.wait_stream(stream)

    @staticmethod
    def _move(pairs, sources, targets) -> None:
        """Bit-exact block copies, all layers."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for (src_k, src_v), (dst_k, dst_v) in zip(sources, targets):
            dst_k[dst.to(dst_k.device)] = src_k[src.to(src_k.device)].to(dst_k.device)
            dst_v[dst.to(dst_v.device)] = src_v[src.to(src_v.device)].to(dst_v.device)
