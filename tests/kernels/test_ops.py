"""The Triton kernel set is a drop-in for the references: same names, signatures, results."""
import inspect

import torch

from kernels.ops import TORCH_OPS, get_ops
from kernels.triton_ops import TRITON_OPS

OP_NAMES = ["paged_attention", "write_kv", "rms_norm", "apply_rotary", "silu_and_mul"]


def test_get_ops_returns_the_triton_set():
    assert get_ops("triton", "cpu") is TRITON_OPS and TRITON_OPS.name == "triton"
    assert get_ops("auto", "cuda") is TRITON_OPS and get_ops("auto", "cpu") is TORCH_OPS


def test_signatures_match_the_references():
    for name in OP_NAMES:
        ref, triton_op = inspect.signature(getattr(TORCH_OPS, name)), inspect.signature(getattr(TRITON_OPS, name))
        assert [(p.name, p.default, p.kind) for p in ref.parameters.values()] == [
            (p.name, p.default, p.kind) for p in triton_op.parameters.values()], name


def test_return_conventions_match():
    x = torch.randn(3, 64)
    for ops in (TORCH_OPS, TRITON_OPS):
        assert ops.rms_norm(x, torch.ones(64), 1e-6)[1] is None
        assert len(ops.rms_norm(x, torch.ones(64), 1e-6, x.clone())) == 2
        assert ops.write_kv(x.view(3, 1, 64), x.view(3, 1, 64), torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 64),
                            torch.tensor([0, -1, 7])) is None
