"""The Triton KV-cache write against the reference: written slots, skipped slots, untouched slots."""
import pytest
import torch

from kernel_helpers import DEVICE, DTYPES, dtype_id, randn
from kernels.cache import write_kv_ref
from kernels.triton_cache import write_kv_triton


def slot_mapping(num_tokens: int, num_blocks: int, block_size: int) -> torch.Tensor:
    """Distinct random slots, every third token skipped (-1)."""
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (1, 128), (3, 80)])
def test_matches_reference(kv_heads, head_dim, dtype, block_size):
    num_tokens, num_blocks = 13, 4
    k, v = randn(num_tokens, kv_heads, head_dim, dtype=dtype), randn(num_tokens, kv_heads, head_dim, dtype=dtype)
    slots = slot_mapping(num_tokens, num_blocks, block_size)
    # poisoned caches: NaN where nothing is written must stay NaN in both
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_triton(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    # a copy: bit-exact
    assert torch.equal(k_cache.isnan(), k_ref.isnan()) and torch.equal(v_cache.isnan(), v_ref.isnan())
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())
    assert int((~k_cache.isnan()).sum()) == int((slots >= 0).sum()) * kv_heads * head_dim


def test_casts_to_cache_dtype_and_reads_strided_views():
    """K and V as views of the fused QKV projection, written into a bf16 cache from fp32."""
    qkv = randn(6, (4 + 2 + 2) * 64)
    k = qkv[:, 4 * 64:6 * 64].view(6, 2, 64)
    v = qkv[:, 6 * 64:].view(6, 2, 64)
    slots = torch.tensor([5, -1, 0, 17, 31, 2], device=DEVICE)
    k_cache = randn(2, 16, 2, 64, dtype=torch.bfloat16)
    v_cache = randn(2, 16, 2, 64, dtype=torch.bfloat16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_triton(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
