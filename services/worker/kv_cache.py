"""The worker's paged KV cache and its CPU swap pool. Block ids come from the scheduler."""
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
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        cpu_shape = (num_cpu_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.block_size, self.num_blocks, self.num_cpu_blocks = block_size, num_blocks, num_cpu_blocks
        # [num_blocks, block_size, KVH, D] per layer, K and V
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_layers)]
        pin = device.type == "cuda"
        self.cpu_layers = [(torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                            torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)) for _ in range(cfg.num_layers)]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:  # (device block, cpu block)
        self._move(pairs, self.layers, self.cpu_layers)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:  # (cpu block, device block)
        self._move(pairs, self.cpu_layers, self.layers)

    def copy(self, pairs: list[tuple[int, int]]) -> None:  # (src, dst) device blocks
        self._move(pairs, self.layers, self.layers)

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
