"""Rotary position embeddings (neox / Hugging Face "rotate_half" layout), Llama 3, linear and YaRN scaling."""
from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """[head_dim // 2] fp32, with Llama 3's frequency-dependent scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":  # a GGUF file's rope_freqs (Llama 3.1+ scaling as llama.cpp stores it)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "linear":  # Gemma 3's global layers (4B and up): positions divided by the factor
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    if kind != "llama3":
        raise ValueError(f"rope_scaling: unsupported type {kind!r}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half, sin in the second (fp32)."""
    if scaling and scaling.get("rope_type") == "longrope":
        return _longrope_cache(head_dim, max_positions, theta, scaling)
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        gain = _yarn_attention_factor(scaling)
        return torch.cat([freqs.cos() * gain, freqs.sin() * gain], dim=-1)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _yarn_attention_factor(scaling: dict) -> float:
    """YaRN's scale of cos and sin: the configured one, else 0.1 ln(factor) + 1 (mscale / mscale_all_dim
    when both are set, DeepSeek's form)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def m(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    factor, mscale, all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(m(factor, mscale) / m(factor, all_dim)) if mscale and all_dim else m(factor)


def _yarn_inverse_frequencies(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071, gpt-oss): the fast-rotating dimensions keep their frequency, the slow ones
    are divided by the factor, a linear ramp between the dimensions that turn beta_fast and beta_slow
    times over the pre-training context (its bounds rounded outwards unless truncate is false)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(turns: float) -> float:  # the dimension that turns `turns` times over the context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    wavelengths = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolate), 0: divided by the factor (interpolate)
    return (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


def _longrope_cache(dim: int, max_positions: int, theta: float, scaling: dict) -> torch.Tensor:
    """Phi-3's LongRoPE: frequencies divided by the short factors at positions inside the pre-training
    context and by the long ones past it, cos and sin scaled by the attention factor. transformers picks
    the factors per forward call (long for every token once the call's longest position passes the
    context); here each position has its own, so a token's rotation does not depend on its batch: the
    same as transformers for contexts inside the pre-training length and for decode steps past it."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    positions = torch.arange(max_positions, dtype=torch.float32)
    caches = []
    for factors in (scaling["short_factor"], scaling["long_factor"]):
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
        freqs = torch.outer(positions, inv_freq)
        caches.append(torch.cat([freqs.cos() * attention, freqs.sin() * attention], dim=-1))
    return torch.where((positions >= original)[:, None], caches[1], caches[0])


def apply_rotary_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int64
    cache: torch.Tensor,  # [max_positions, D] from cos_sin_cache
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cos, sin = cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], -1)[:, None, :]
    sin = torch.cat([sin, sin], -1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    return rotate(q), rotate(k)
