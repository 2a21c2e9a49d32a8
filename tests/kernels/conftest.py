"""Kernel tests: Triton kernels against their PyTorch references.

Without CUDA the kernels run in Triton's interpreter on the CPU; TRITON_INTERPRET must be
set before triton (or any kernels.triton_* module) is imported, hence the top of this file.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped without CUDA (they stay in the suite)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("KERNEL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"KERNEL_TEST_SEED={seed}")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Makes torch.empty return NaN-filled (float) or -1-filled (int) tensors while the test
    runs, so an output element a kernel never writes shows up in the comparison."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)
