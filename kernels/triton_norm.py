"""RMSNorm in Triton, with the residual add fused in front; one row per program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import DTYPES, Launch, round_to
MAX_ROW = 65536  # one program holds a whole row: no split reduction


@triton.jit
def _row_rms_scale(x, N: tl.constexpr, eps):
    """1 / sqrt(mean(x^2) + eps) of one fp32 row (padding holds zeros)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, N]
    residual_ptr,  # [R, N] (unused without HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [R, N] in promote(weight, x) dtype
    new_residual_ptr,  # [R, N] x + residual in x's dtype (unused without HAS_RESIDUAL)
    eps,
    stride_x, stride_r, stride_o, stride_nr,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    if HAS_RESIDUAL:  # the sum is rounded to x's dtype before the norm, as in the reference
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = round_to(x32 + residual.to(tl.float32), dtype)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
        x32 = x.to(tl.float32)
    normed = round_to(x32 * _row_rms_scale(x32, N, eps), dtype)  # the reference rounds here too
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., N]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for kernels.norm.rms_norm_ref: (normed, x + residual or None)."""
    num_cols = x.shape[-1]
    assert weight.shape == (num_cols,), f"weight {tuple(weight.shape)} vs row length {num_cols}"
    assert x.dtype in DTYPES and weight.dtype in DTYPES, f"unsupported dtypes {x.dtype}, {weight.dtype}"
    assert num_cols <= MAX_ROW, f"row length {num_cols} > {MAX_ROW}"
    x2 = x.reshape(-1, num_cols)  # a view for the worker's [T, N] and contiguous [T, H, D] inputs
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual: x's shape and dtype"
        res2 = residual.reshape(-1, num_cols)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        new_res = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        res2 = new_res = x2  # placeholders, never read or written
    if x2.shape[0] > 0:
        Launch(kernel=_rms_norm_kernel, grid=(x2.shape[0],), args=(
            x2, res2, weight, out, new_res, float(eps),
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
        ), constexprs=dict(N=num_cols, BLOCK_N=triton.next_power_of_2(num_cols),
                           HAS_RESIDUAL=residual is not None)).launch()
    out = out.view(x.shape)
    return out, (new_res.view(x.shape) if residual is not None else None)
