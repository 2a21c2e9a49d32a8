"""quant_dot.c's AMX tiles (the avx512 tier on a CPU with AMX-INT8, m >= 10 rows, interleaved groups of 16
outputs): the VNNI tiles' bits (cpu_kernels.set_amx(False), the amx setting, forces those) on every format, row count 1..40 (whole
tiles of 16, a last part tile by AMX or by VNNI), output counts with and without a part group, block counts
around the four-block pipeline, bias or none, fp32 and bf16; and the reference's. An allocation the AMX
path is refused (out of memory) leaves the VNNI tiles' bits too."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kernels import build, cpu_kernels, quant
from tests.kernels.test_quant import make_weight
from tests.kernels.test_quant_dot import _bits, _hard_rows

FORMATS = ["q4_0", "q4_1", "q8_0", "int8"]


@pytest.fixture(scope="module")
def lib():
    if "avx512" not in build.host_tiers():
        pytest.skip("no AVX-512 tier here")
    lib = quant.declare(cpu_kernels.tier_library("avx512"))
    lib.quant_dot_amx.argtypes, lib.quant_dot_amx.restype = [], ctypes.c_int
    if not lib.quant_dot_amx():
        pytest.skip("no AMX path here (CPU, compiler or kernel permission)")
    return lib


def _both(lib, monkeypatch, x, weight, bias):
    amx = quant.run_kernel(lib, x, weight, bias)
    cpu_kernels.set_amx(False)
    try:
        vnni = quant.run_kernel(lib, x, weight, bias)
    finally:
        cpu_kernels.set_amx(True)
    return amx, vnni


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_row_count_gives_the_vnni_bits(lib, monkeypatch, fmt, dtype):
    weight, _ = make_weight(fmt, 40, 160, dtype, seed=11)  # 2 groups of 16 and 8 rows in order; 5 blocks
    weight = weight.with_activations(True)
    assert weight.interleaved
    x = _hard_rows(40, 160, dtype, seed=4)
    bias = torch.randn(40).to(dtype)
    for m in range(1, 41):
        for b in (bias, None):
            amx, vnni = _both(lib, monkeypatch, x[:m], weight, b)
            assert torch.equal(_bits(amx), _bits(vnni)), (m, b is None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [32, 64, 96, 128, 576])
@pytest.mark.parametrize("n", [16, 33, 70])
def test_every_shape_gives_the_vnni_and_reference_bits(lib, monkeypatch, fmt, k, n):
    weight, _ = make_weight(fmt, n, k, torch.float32, seed=n + k)
    weight = weight.with_activations(True)
    for m, dtype in ((16, torch.float32), (29, torch.bfloat16), (35, torch.float32)):
        x = _hard_rows(m, k, dtype, seed=m)
        bias = torch.randn(n).to(dtype)
        w = replace(weight, dtype=dtype)
        amx, vnni = _both(lib, monkeypatch, x, w, bias)
        assert torch.equal(_bits(amx), _bits(vnni)), (m, dtype)
        want = quant.int8_linear_reference(x, w, bias).to(dtype)
        assert torch.equal(_bits(amx), _bits(want)), (m, dtype)


def test_threads_and_rows_in_place(lib, monkeypatch):
    """The bits do not depend on the thread count, a row's place in the batch, or the row stride."""
    weight, _ = make_weight("q8_0", 96, 576, torch.float32, seed=5)
    weight = weight.with_activations(True)
    wide = _hard_rows(48, 700, torch.float32, seed=9)
    x = wide[:, :576]  # a row stride of 700
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        amx2, vnni = _both(lib, monkeypatch, x, weight, None)
        torch.set_num_threads(1)
        amx1, _ = _both(lib, monkeypatch, x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(amx1, vnni) and torch.equal(amx2, vnni)
    assert torch.equal(quant.run_kernel(lib, x[7:30], weight, None), vnni[7:30])


def test_the_tile_permission_with_a_small_signal_stack():
    """A process whose thread already has a small sigaltstack (faulthandler's): Linux may refuse the tile data
    then; the kernel must give the VNNI bits either way, and not die (a subprocess, as llama.cpp's AMX
    kernels died with SIGILL on a VM where a small program ran AMX)."""
    code = (
        "import faulthandler, torch; faulthandler.enable()\n"
        "from kernels import cpu_kernels, quant\n"
        "from tests.kernels.test_quant import make_weight\n"
        "lib = quant.declare(cpu_kernels.tier_library('avx512'))\n"
        "w, _ = make_weight('q4_1', 48, 576, torch.float32); w = w.with_activations(True)\n"
        "x = torch.randn(16, 576)\n"
        "a = quant.run_kernel(lib, x, w, None)\n"
        "cpu_kernels.set_amx(False)\n"
        "b = quant.run_kernel(lib, x, w, None)\n"
        "assert torch.equal(a, b)\n"
        "print('amx', lib.quant_dot_amx())\n")
    if "avx512" not in build.host_tiers():
        pytest.skip("no AVX-512 tier here")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_row_parallel_groups_give_the_vnni_bits(lib, monkeypatch, fmt, dtype):
    """quant_linear_int8_groups (o_proj and down_proj, TP = 1): each K group's AMX partial, folded in group order,
    the VNNI tiles' bits; whole groups of 16 outputs and the rows past them (40 outputs), row counts around the
    tile's edges and the AMX threshold, 2 and 3 K groups."""
    from kernels.row_parallel import RowParallelWeight
    from tests.kernels.test_row_parallel import _parts
    gen = torch.Generator().manual_seed(8)
    for out_features, groups, kg in ((40, 3, 64), (48, 2, 192)):
        dense = torch.randn(out_features, groups * kg, generator=gen).to(dtype)
        whole = RowParallelWeight.build([p.with_activations(True) for p in _parts(dense, fmt, dtype, groups)], groups)
        x = _hard_rows(40, groups * kg, dtype, seed=kg)
        for m in (9, 10, 13, 16, 17, 26, 29, 32, 40):
            amx = whole(x[:m], None)
            cpu_kernels.set_amx(False)
            try:
                vnni = whole(x[:m], None)
            finally:
                cpu_kernels.set_amx(True)
            assert torch.equal(_bits(amx), _bits(vnni)), (out_features, groups, m)
            assert torch.equal(_bits(amx), _bits(whole.fold(whole.partials(x[:m]), dtype))), (out_features, m)


FAIL_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
/* aligned_alloc refused for one size (FAIL_ALIGNED_ALLOC_BYTES): the kernels' scratch asking for it is out of memory */
void *aligned_alloc(size_t alignment, size_t size) {
    static void *(*real)(size_t, size_t);
    if (real == NULL)
        real = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "aligned_alloc");
    const char *refused = getenv("FAIL_ALIGNED_ALLOC_BYTES");
    if (refused != NULL && (size_t)atol(refused) == size) {
        fprintf(stderr, "refused aligned_alloc %zu\n", size);
        errno = ENOMEM;
        return NULL;
    }
    return real(alignment, size);
}
"""


# (format, the bytes refused): 16 rows by 5 blocks of 32 (k = 160). 3200: the packed A rows (2560 bytes of q,
# d and sx 320 each rounded to 64); 2560: a thread's unpacked Q4 blocks (5 x 512)
@pytest.mark.parametrize("fmt, refused", [("q8_0", 3200), ("q4_1", 3200), ("q4_1", 2560)])
@pytest.mark.parametrize("rows_parallel", [False, True], ids=["linear", "row-parallel"])
def test_out_of_memory_for_the_amx_buffers_falls_back_to_the_vnni_tiles(lib, tmp_path, fmt, refused, rows_parallel):
    """A refused allocation of the AMX path's buffers (a fresh process, so the scratch is empty): the
    VNNI tiles make every output, with their bits, instead of a MemoryError."""
    (tmp_path / "shim.c").write_text(FAIL_SHIM)
    shim = tmp_path / "fail_alloc.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"], check=True)
    if rows_parallel:  # o_proj's path: two K groups of 160
        make = ("from kernels.row_parallel import RowParallelWeight\n"
                "from tests.kernels.test_row_parallel import _parts\n"
                f"w = RowParallelWeight.build([p.with_activations(True) for p in _parts(torch.randn(32, 320), "
                f"'{fmt}', torch.float32, 2)], 2)\n"
                "run = lambda x: w(x, None)\n")
        k = 320
    else:
        make = (f"w, _ = make_weight('{fmt}', 32, 160, torch.float32); w = w.with_activations(True)\n"
                "run = lambda x: quant.run_kernel(lib, x, w, None)\n")
        k = 160
    code = ("import os, torch\n"
            "from kernels import cpu_kernels, quant\n"
            "from tests.kernels.test_quant import make_weight\n"
            "lib = quant.declare(cpu_kernels.tier_library('avx512'))\n"
            + make +
            f"x = torch.randn(16, {k}, generator=torch.Generator().manual_seed(3))\n"
            "got = run(x)\n"
            "cpu_kernels.set_amx(False)\n"
            "want = run(x)\n"
            "assert torch.equal(got.view(torch.int32), want.view(torch.int32))\n")
    if rows_parallel:  # both K groups' buffers in one
        refused *= 2
    env = {**os.environ, "OMP_NUM_THREADS": "2", "LD_PRELOAD": str(shim), "FAIL_ALIGNED_ALLOC_BYTES": str(refused)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"refused aligned_alloc {refused}" in result.stderr  # the path under test ran
