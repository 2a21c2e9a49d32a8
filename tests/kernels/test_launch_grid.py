"""The launch grid of every Triton kernel for batch sizes 1..256, and one compiled binary for all of
them (without a GPU: the wrappers run on meta tensors and hand their launches to a recorder).

Runs in a subprocess without TRITON_INTERPRET (this directory's conftest sets it), so Triton
specialises the arguments as its JIT would on a GPU (services.tools.gpu_compile.specialise).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from services.tools import gpu_compile
    raw = gpu_compile.model_configs(None)["Qwen3-0.6B"]  # q/k norm: every kernel and call site
    steps = {}
    for batch in range(1, 257):
        seqs = [(1 + (37 * i + 11 * batch) % 3000, 1) for i in range(batch)]  # decode tokens
        if batch % 8 == 0:
            seqs[0] = (seqs[0][0] + 40, 41)  # and a prefill chunk
        launches = gpu_compile.record_step(raw, torch.bfloat16, 16, seqs)
        steps[batch] = dict(tokens=sum(q for _, q in seqs), launches=[
            [l.name, list(l.grid), repr(gpu_compile.specialise(l, 90)[0])] for l in launches])
    json.dump(steps, sys.stdout)
''')
HEADS, KV_HEADS = 16, 8  # Qwen3-0.6B


@pytest.fixture(scope="module")
def steps() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(batch): step for batch, step in json.loads(proc.stdout).items()}


@pytest.mark.slow
def test_one_program_per_token_and_head(steps):
    for batch, step in steps.items():
        tokens = step["tokens"]
        expected = {  # kernel -> the grids its call sites may launch
            "_paged_attention_kernel": [[tokens, KV_HEADS]],
            "_rms_norm_kernel": [[tokens], [tokens * HEADS], [tokens * KV_HEADS]],  # layer norms, q norm, k norm
            "_rotary_kernel": [[tokens]], "_write_kv_kernel": [[tokens]], "_silu_and_mul_kernel": [[tokens]],
        }
        for name, grid, _ in step["launches"]:
            assert grid in expected[name], (batch, name, grid)
            assert grid[0] < 2**31 and all(g < 65536 for g in grid[1:]), (batch, name, grid)
        assert sorted(name for name, _, _ in step["launches"]) == sorted(
            ["_rms_norm_kernel"] * 5 + ["_rotary_kernel", "_write_kv_kernel", "_paged_attention_kernel",
                                        "_silu_and_mul_kernel"]), batch


@pytest.mark.slow
def test_every_batch_size_runs_the_same_binaries(steps):
    """A batch's size and its longest context choose no other compiled code: a row's bits cannot
    depend on its neighbours through the code, and no batch triggers a compile mid-serving."""
    first = [key for _, _, key in steps[1]["launches"]]
    for batch, step in steps.items():
        assert [key for _, _, key in step["launches"]] == first, batch
