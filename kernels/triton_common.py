"""What every Triton kernel file shares: supported dtypes, interpreter detection, rounding, and
the one way a wrapper launches its kernel (`Launch`), which the ahead-of-time compiler
(services/tools/gpu_compile.py) and the launch-grid tests read instead of launching.

Triton's CPU interpreter (TRITON_INTERPRET=1) stores bf16 as raw uint16, so arithmetic on
bf16 values there is meaningless (kernels convert to fp32 first), and its fp32 -> bf16
cast truncates instead of rounding to nearest even. `round_to` rounds like a GPU (and like
torch) in both modes, so interpreter tests measure the kernel, not the interpreter.

Floating-point contraction is off (FP_FUSION): on a GPU every `a * b + c` the kernels write
is a rounded multiply and then a rounded add, as the interpreter (numpy, one op at a time)
and the PyTorch references compute it, never a fused multiply-add. docs/ARCHITECTURE.md
("Floating-point contraction on the GPU") says what that buys and what it does not.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import triton
import triton.language as tl

# Triton's own reading of TRITON_INTERPRET (its knob, the one triton.jit obeys when it decorates a
# kernel), not a second reading of the environment that could disagree with it.
INTERPRET = bool(triton.knobs.runtime.interpret)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Triton's enable_fp_fusion, passed at every launch (the interpreter drops it: it never fuses).
# Explicit, so neither TRITON_DEFAULT_FP_FUSION nor Triton 3.10's changed default moves the bits.
FP_FUSION = False
_INTERPRET_BF16_FIX = tl.constexpr(INTERPRET)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x (any float dtype) rounded to nearest even in DTYPE."""
    if _INTERPRET_BF16_FIX:  # compile-time: on a GPU only the plain cast below exists
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.int32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round half to even at bit 16
            bits = (bits >> 16) << 16  # now exact in bf16, so the truncating cast is exact
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(DTYPE)


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One kernel launch as a wrapper decided it: the grid, the runtime arguments in the kernel's
    order, and the compile-time constants. `launch()` runs it (or hands it to a recorder)."""

    kernel: Any  # a triton JITFunction (an InterpretedFunction under TRITON_INTERPRET)
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def options(self) -> dict[str, Any]:
        """Triton compile options every launch passes."""
        return {"enable_fp_fusion": FP_FUSION}

    def launch(self) -> None:
        if _recorders:
            _recorders[-1](self)
            return
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


_recorders: list[Callable[[Launch], None]] = []


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, Launch.launch() appends to the yielded list instead of running a kernel
    (the wrappers still check and allocate, so tensors on the meta device work)."""
    launches: list[Launch] = []
    _recorders.append(launches.append)
    try:
        yield launches
    finally:
        _recorders.remove(launches.append)
