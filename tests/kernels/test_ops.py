"""The Triton and CPU kernel sets are drop-ins for the references: same names, signatures, results."""
import inspect

import torch

from kernels import cpu_kernels
from kernels.ops import CPU_OPS, TORCH_OPS, get_ops
from kernels.triton_ops import TRITON_OPS

OP_NAMES = ["paged_attention", "write_kv", "rms_norm", "apply_rotary", "silu_and_mul"]


def test_get_ops_returns_the_triton_set():
    assert get_ops("triton", "cpu") is TRITON_OPS and TRITON_OPS.name == "triton"
    assert get_ops("auto", "cuda") is TRITON_OPS and get_ops("torch", "cpu") is TORCH_OPS


def test_auto_on_the_cpu_takes_the_compiled_attention_where_it_builds():
    want = CPU_OPS if cpu_kernels.is_available() else TORCH_OPS
    assert get_ops("auto", "cpu") is want


def test_signatures_match_the_references():
    for ops in (TRITON_OPS, CPU_OPS):
        for name in OP_NAMES:
            ref, op = inspect.signature(getattr(TORCH_OPS, name)), inspect.signature(getattr(ops, name))
            assert [(p.name, p.default, p.kind) for p in ref.parameters.values()] == [
                (p.name, p.default, p.kind) for p in op.parameters.values()], (ops.name, name)


def test_return_conventions_match():
    x = torch.randn(3, 64)
    for ops in (TORCH_OPS, TRITON_OPS):
        assert ops.rms_norm(x, torch.ones(64), 1e-6)[1] is None
        assert len(ops.rms_norm(x, torch.ones(64), 1e-6, x.clone())) == 2
        assert ops.write_kv(x.view(3, 1, 64), x.view(3, 1, 64), torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 64),
                            torch.tensor([0, -1, 7])) is None
