"""The Triton kernel set, with the reference signatures (see kernels.ops.Ops)."""
from __future__ import annotations

from kernels.ops import Ops
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_attention import paged_attention_triton
from kernels.triton_cache import write_kv_triton
from kernels.triton_norm import rms_norm_triton
from kernels.triton_rotary import apply_rotary_triton

TRITON_OPS = Ops(
    name="triton",
    paged_attention=paged_attention_triton,
    write_kv=write_kv_triton,
    rms_norm=rms_norm_triton,
    apply_rotary=apply_rotary_triton,
    silu_and_mul=silu_and_mul_triton,
)
