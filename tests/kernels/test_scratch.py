"""The kernels' scratch kept between calls (kernels/csrc/scratch.c): each thread has its own, so calls
from several threads at once give the bits each gives alone, and a call after a larger or smaller one
(the buffers grown, or kept and reused, or given back past 1 MiB) gives its own bits too."""
from __future__ import annotations

import threading

import pytest
import torch

from kernels import cpu_kernels, quant
from tests.kernels.test_quant import make_weight
from tests.kernels.test_quant_dot import _bits, _hard_rows


@pytest.fixture(scope="module")
def lib():
    if not cpu_kernels.is_available():
        pytest.skip("no compiled CPU kernels here")
    return quant.declare(cpu_kernels.library())


# (format, rows, outputs, inputs): the AMX tiles where the CPU has them (16+ rows) and the VNNI ones
# (5 rows, and 70 outputs: a part group), a row count whose buffers pass 1 MiB (given back after)
CASES = [("q4_1", 16, 96, 576), ("q8_0", 16, 70, 1536), ("q4_0", 5, 48, 576), ("int8", 24, 64, 256),
         ("q4_1", 700, 32, 1536)]


def _run(lib, case, seed):
    fmt, m, n, k = case
    weight, _ = make_weight(fmt, n, k, torch.bfloat16, seed=n + k)
    weight = weight.with_activations(True)
    x = _hard_rows(m, k, torch.bfloat16, seed=seed)
    return quant.run_kernel(lib, x, weight, None)


def test_threads_at_once_give_each_calls_own_bits(lib):
    want = {(i, seed): _bits(_run(lib, case, seed)) for i, case in enumerate(CASES) for seed in (1, 2)}
    got, errors = {}, []

    def worker(i: int, seed: int) -> None:
        try:
            for _ in range(3):  # each thread's calls interleave with the others'
                got.setdefault((i, seed), []).append(_bits(_run(lib, CASES[i], seed)))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=key) for key in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for key, expected in want.items():
        assert all(torch.equal(out, expected) for out in got[key]), key


def test_a_call_after_a_larger_or_smaller_one_gives_its_own_bits(lib):
    alone = [_bits(_run(lib, case, 3)) for case in CASES]
    for order in (CASES[::-1], CASES[2:] + CASES[:2]):
        for case in order:
            assert torch.equal(_bits(_run(lib, case, 3)), alone[CASES.index(case)]), case
