"""SiLU-and-multiply in Triton: [T, 2I] -> [T, I], one row per program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import DTYPES, Launch, round_to
BLOCK_COLS = 1024  # columns per loop step; no reduction, so the step size changes no bits


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) rounded to gate's dtype, times up, as F.silu(gate) * up does."""
    g = gate.to(tl.float32)
    silu = round_to(g / (1.0 + tl.exp(-g)), gate.dtype)
    return silu.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]: gate in the first half, up in the second
    out_ptr,  # [T, I]
    stride_x, stride_o,
    INTER: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, INTER, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < INTER
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * stride_o + cols, round_to(_silu_mul(gate, up), out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Drop-in for kernels.activation.silu_and_mul_ref."""
    assert x.shape[-1] % 2 == 0, f"last dimension {x.shape[-1]} must be even"
    assert x.dtype in DTYPES, f"unsupported dtype {x.dtype}"
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        Launch(kernel=_silu_and_mul_kernel, grid=(x2.shape[0],), args=(x2, out, x2.stride(0), out.stride(0)),
               constexprs=dict(INTER=inter, BLOCK=min(BLOCK_COLS, triton.next_power_of_2(inter)))).launch()
    return out.view(*x.shape[:-1], inter)
