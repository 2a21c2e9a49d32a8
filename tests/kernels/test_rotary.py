"""The Triton rotary embedding against the reference, and the reference against complex rotation."""
import pytest
import torch

from kernel_helpers import DEVICE, DTYPES, dtype_id, randn
from kernels.rotary import apply_rotary_ref, cos_sin_cache
from kernels.triton_rotary import apply_rotary_triton

LLAMA3_SCALING = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
# Bit for bit, in every dtype: the kernel rounds where the reference rounds, and with contraction off
# (kernels.triton_common.FP_FUSION) a GPU fuses no multiply into the add after it either.
EXACT = dict(atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads,kv_heads,head_dim,scaling", [
    (8, 2, 64, LLAMA3_SCALING), (4, 4, 128, None), (6, 2, 80, None), (3, 1, 96, LLAMA3_SCALING),
])
def test_matches_reference(heads, kv_heads, head_dim, scaling, dtype, poisoned_empty):
    cache = cos_sin_cache(head_dim, 4096, 500000.0, scaling).to(DEVICE)
    positions = torch.randint(0, 4096, (9,), device=DEVICE)
    q, k = randn(9, heads, head_dim, dtype=dtype), randn(9, kv_heads, head_dim, dtype=dtype)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = apply_rotary_triton(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, **EXACT)
    torch.testing.assert_close(k_out, k_ref, **EXACT)
    assert torch.equal(q, q_in) and torch.equal(k, k_in), "returns new tensors, like the reference"


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=dtype_id)
def test_table_in_the_models_dtype(dtype, poisoned_empty):
    """A bf16/fp16 model's Module.to(dtype) casts its rotary table too (a buffer): the kernel takes it
    and gives the bits it gives with the fp32 table, which it rounds to q's dtype itself."""
    cache = cos_sin_cache(64, 512, 10000.0, LLAMA3_SCALING | dict(original_max_position_embeddings=128)).to(DEVICE)
    positions = torch.randint(0, 512, (5,), device=DEVICE)
    q, k = randn(5, 4, 64, dtype=dtype), randn(5, 2, 64, dtype=dtype)
    from_model_table = apply_rotary_triton(q, k, positions, cache.to(dtype))
    for out, fp32_table in zip(from_model_table, apply_rotary_triton(q, k, positions, cache)):
        assert torch.equal(out, fp32_table)


def test_strided_views_of_qkv(poisoned_empty):
    qkv = randn(4, (8 + 2 + 2) * 64)
    q, k = qkv[:, : 8 * 64].view(4, 8, 64), qkv[:, 8 * 64:10 * 64].view(4, 2, 64)
    cache = cos_sin_cache(64, 128, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 77, 127], device=DEVICE)
    for out, ref in zip(apply_rotary_triton(q, k, positions, cache), apply_rotary_ref(q, k, positions, cache)):
        torch.testing.assert_close(out, ref, **EXACT)


def test_reference_is_a_complex_rotation():
    """rotate_half layout: dims i and i + D/2 rotate as one complex number by pos * inv_freq_i."""
    head_dim, theta = 64, 10000.0
    positions = torch.tensor([0, 3, 1000])
    q, k = torch.randn(3, 2, head_dim), torch.randn(3, 1, head_dim)
    q_ref, _ = apply_rotary_ref(q, k, positions, cos_sin_cache(head_dim, 1024, theta))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    z = torch.complex(q[..., : head_dim // 2].double(), q[..., head_dim // 2:].double()) * torch.polar(
        torch.ones_like(angle), angle)[:, None, :]
    torch.testing.assert_close(q_ref.double(), torch.cat([z.real, z.imag], -1), atol=1e-4, rtol=1e-4)


def test_longrope_cache_equals_transformers_short_and_long():
    """Phi-3's LongRoPE (partial rotary): inside the pre-training context the short factors' table, past it
    the long ones', both scaled by the attention factor, bit for bit as transformers rotates a token
    there (a decode step's call)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from services.tools.arch_models import arch_config
    from services.tools.make_model import SIZES
    from services.worker.model_config import ModelArchConfig

    config = arch_config("phi3", dict(SIZES["tiny"]))
    ours = ModelArchConfig.from_dict(config)
    table = cos_sin_cache(ours.rotary_dim, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling)
    hf = Phi3RotaryEmbedding(Phi3Config(**config))
    original = config["original_max_position_embeddings"]
    half = ours.rotary_dim // 2
    for pos in (0, 5, original - 1, original, original + 37):
        cos, sin = hf(torch.zeros(1), torch.tensor([[pos]]))  # one token: transformers' decode step at pos
        assert torch.equal(table[pos], torch.cat([cos[0, 0, :half], sin[0, 0, :half]])), pos
    assert not torch.equal(table[original - 1, :half], cos_sin_cache(ours.rotary_dim, original, ours.rope_theta)[
        original - 1, :half])  # the short factors and the attention factor do change the table
