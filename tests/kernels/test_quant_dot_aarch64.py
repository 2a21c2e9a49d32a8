"""The int8-activation kernels (kernels/csrc/quant_dot.c) built for aarch64 and run under qemu-user give
this host's bits (the build with the dot-product extension: sdot, NEON FMAs). Needs Debian's gcc-aarch64-linux-gnu and qemu-user (.ci/run installs them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_kernels, quant
from tests.kernels import aarch64
from tests.kernels.test_kquant_dot import FORMATS as KQUANTS
from tests.kernels.test_kquant_dot import kquant_weight
from tests.kernels.test_quant import make_weight


pytestmark = [pytest.mark.slow, pytest.mark.skipif(aarch64.MISSING is not None, reason=str(aarch64.MISSING))]


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


# with the dot-product extension (sdot); the baseline build's plain integer loops are the host's
# generic tier's, which tests/kernels/test_quant_dot.py compares with the reference
@pytest.mark.parametrize("march", ["armv8.2-a+dotprod"])
def test_aarch64_gives_the_hosts_bits(tmp_path, march):
    exe = aarch64.check_executable("quant_dot_check.c", tmp_path / "quant_dot_check", march)
    blob, expected = b"", []
    cases = [(f, d, s) for f in ("q4_0", "q4_1", "q8_0", "int8") for d in (torch.float32, torch.bfloat16)
             for s in ((3, 20, 576), (1, 9, 64))] + [("int8", torch.float32, (2, 11, 45))]
    cases += [(f, torch.float32, (3, 20, 512)) for f in KQUANTS] + [("q4_k", torch.bfloat16, (1, 9, 256))]
    for i, (fmt, dtype, (m, n, k)) in enumerate(cases):
        if fmt in KQUANTS:
            weight = kquant_weight(fmt, n, k, seed=i, dtype=dtype)
        else:
            weight, _ = make_weight(fmt, n, k, dtype, seed=i)
            weight = weight.with_activations(True)
        gen = torch.Generator().manual_seed(i)
        x = (torch.randn(m, k, generator=gen) * 4).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        host = quant.run_kernel(quant.declare(cpu_kernels.library()), x, weight, bias)
        assert torch.equal(host, quant.int8_linear_reference(x, weight, bias).to(dtype))
        header = np.array([m, n, k, weight.kernel_fmt, int(dtype == torch.bfloat16), 1, weight.data.numel()], np.int64)
        blob += header.tobytes() + _bytes(x) + weight.data.numpy().tobytes() + _bytes(bias)
        expected.append(_bytes(host))
    assert aarch64.run(exe, blob, tmp_path)[1] == b"".join(expected)
