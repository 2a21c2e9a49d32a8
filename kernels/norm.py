"""RMSNorm, optionally with the residual add fused in front (Hugging Face's numerics)."""
from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new_residual). With a residual: new_residual = x + residual, and the
    norm is taken of that sum. Statistics in fp32, one row at a time (row-invariant)."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual
