"""The Triton kernels, compiled ahead of time for Hopper (sm_90) and Ampere (sm_80) on this CPU-only
machine (services/tools/gpu_compile.py), and the floating-point contraction setting they compile with.

Each runs in a subprocess without TRITON_INTERPRET: the kernel tests' conftest sets it for the
whole session, and an interpreted kernel cannot be compiled.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("_paged_attention_kernel", "_write_kv_kernel", "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel")


def run_python(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def table_rows(out: str, kernel: str, arch: str) -> list[list[str]]:
    """The data rows of one kernel's table, cells stripped."""
    section = out.split(f"### {kernel}, {arch}\n", 1)[1].strip("\n").split("\n\n", 1)[0]
    header, _, *rows = section.splitlines()
    assert header.startswith("| variant | registers |"), header
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # about a CPU-minute; the rest is a loaded host's wait
def test_every_kernel_the_worker_launches_compiles_for_sm90_and_sm80():
    """The suite's subset: each kernel, each dtype, block sizes 8/16/32, head dims 64 and 128, q/k norm
    (the full matrix: bench/results/gpu_compile.md)."""
    proc = run_python(["-m", "services.tools.gpu_compile", "--arch", "sm_90,sm_80", "--subset", "suite",
                       "--jobs", "2"], timeout=1400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    planned = int(re.match(r"(\d+) kernel variants to compile", out).group(1))
    assert out.rstrip().splitlines()[-2:] == [f"{planned // 2} kernels compiled for sm_90",
                                               f"{planned // 2} kernels compiled for sm_80"]
    assert "FAILED" not in out
    for arch in ("sm_90", "sm_80"):
        for kernel in KERNELS:
            rows = table_rows(out, kernel, arch)
            assert rows, (kernel, arch)
            for variant, registers, shared, spills, warps, cubin, fp32_fma, *_ in rows:
                assert 0 < int(registers) <= 255 and int(cubin) > 0, (kernel, variant)
                if kernel != "_paged_attention_kernel":  # tl.dot on FMA units fuses by definition
                    assert fp32_fma == "0", (kernel, variant, "a contracted multiply-add")
        labels = " ".join(row[0] for kernel in KERNELS for row in table_rows(out, kernel, arch))
        for needed in ("*fp32", "*bf16", "*fp16", "BLOCK_SIZE=8", "BLOCK_SIZE=16", "BLOCK_SIZE=32",
                       "HEAD_DIM=64", "HEAD_DIM=128", "N=128", "NATIVE_DOT=True", "NATIVE_DOT=False"):
            assert needed in labels, needed


FUSION_SCRIPT = textwrap.dedent('''
    import dataclasses, torch
    from services.tools import gpu_compile
    raw = gpu_compile.model_configs("suite")["SmolLM2-135M"]
    launch = next(l for l in gpu_compile.record_step(raw, torch.float32, 16) if l.name == "_rms_norm_kernel")
    _, job = gpu_compile.specialise(launch, 90)
    fused = dataclasses.replace(job, options={**job.options, "enable_fp_fusion": True})
    for result in map(gpu_compile.compile_job, (job, fused)):
        assert result.error is None, result.error
        print(result.job.options["enable_fp_fusion"], result.ptx_fma)
''')


@pytest.mark.slow
def test_kernels_compile_without_fp_contraction():
    """The kernels' own setting (kernels.triton_common.FP_FUSION) leaves every multiply and add rounded
    on its own, as the interpreter computes them; Triton's default would fuse the norm's x * x + sum."""
    proc = run_python(["-c", FUSION_SCRIPT], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, fused = proc.stdout.split("\n")[:2]
    assert ours == "False 0"
    assert fused.startswith("True ") and int(fused.split()[1]) > 0


def test_refuses_an_unknown_architecture():
    proc = run_python(["-m", "services.tools.gpu_compile", "--arch", "sm_75"], timeout=120)
    assert proc.returncode == 2 and "--arch: 'sm_75' is not one of" in proc.stderr
