"""The set of kernels a model calls, chosen once per worker: PyTorch references, the compiled CPU
kernels, or Triton."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels import cpu_kernels
from kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from kernels.attention import paged_attention_ref
from kernels.cache import write_kv_ref
from kernels.decoder import DecoderStack
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref


@dataclass(frozen=True, kw_only=True)
class Ops:
    name: str
    paged_attention: Callable  # see kernels.attention.paged_attention_ref
    write_kv: Callable  # see kernels.cache.write_kv_ref
    rms_norm: Callable  # see kernels.norm.rms_norm_ref
    apply_rotary: Callable  # see kernels.rotary.apply_rotary_ref
    silu_and_mul: Callable  # see kernels.activation.silu_and_mul_ref
    # the whole decoder stack in one call where the backend has one (kernels.decoder.DecoderStack.build)
    decoder_stack: Callable | None = None
    # a mixture-of-experts router's softmax and top-k (kernels.cpu_kernels.moe_route_cpu's signature) where the
    # backend has its own; None: torch's (services/worker/models/moe.py)
    moe_route: Callable | None = None
    # Gemma's MLP activation: elementwise, so every backend takes the PyTorch one (kernels.activation)
    gelu_tanh_and_mul: Callable = gelu_tanh_and_mul_ref


TORCH_OPS = Ops(name="torch", paged_attention=paged_attention_ref, write_kv=write_kv_ref, rms_norm=rms_norm_ref,
                apply_rotary=apply_rotary_ref, silu_and_mul=silu_and_mul_ref)
# the kernels compiled for the CPU (kernels/cpu_kernels.py), same signatures
CPU_OPS = Ops(name="cpu", paged_attention=cpu_kernels.paged_attention_cpu, write_kv=cpu_kernels.write_kv_cpu,
              rms_norm=cpu_kernels.rms_norm_cpu, apply_rotary=cpu_kernels.apply_rotary_cpu,
              silu_and_mul=cpu_kernels.silu_and_mul_cpu, decoder_stack=DecoderStack.build,
              moe_route=cpu_kernels.moe_route_cpu)


def get_ops(backend: str, device_type: str, cpu_isa: str = "auto") -> Ops:
    """backend: auto (triton on cuda; on the CPU, the compiled kernels where a C compiler
    builds them, else the references), torch, cpu, or triton. cpu_isa: the compiled kernels'
    tier (kernels.cpu_kernels.select_isa: auto, avx512, avx2, generic); a tier this CPU cannot
    execute is a ValueError, whatever the backend, and a forced tier that does not build raises
    KernelUnavailable."""
    if device_type == "cpu" and (cpu_isa != "auto" or backend == "cpu"):
        cpu_kernels.select_isa(cpu_isa)  # the process's tier, checked now rather than at the first step
    elif device_type == "cpu":
        try:
            cpu_kernels.select_isa("auto")
        except cpu_kernels.KernelUnavailable:
            pass  # auto falls back to the references below
    if backend == "auto":
        if device_type == "cuda":
            backend = "triton"
        else:
            backend = "cpu" if cpu_kernels.is_available() else "torch"
    if backend == "torch":
        return TORCH_OPS
    if backend == "cpu":
        cpu_kernels.library()  # raises KernelUnavailable, with the compiler's message, when asked for explicitly
        return CPU_OPS
    if backend == "triton":
        from kernels.triton_ops import TRITON_OPS  # imports triton only when asked

        return TRITON_OPS
    raise ValueError(f"kernel_backend: unknown backend {backend!r}")
