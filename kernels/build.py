"""The CPU kernels' build: which tiers this CPU runs, each tier's compiler flags, and the compiled
library of kernels/csrc/*.c per tier, cached on disk (kernels/cpu_kernels.py loads it and wraps its
entry points through ctypes).

Tiers: the same sources are compiled once per instruction set (TIER_FLAGS), one library
each, and the C code picks its paths from the compiler's target macros (`#if
defined(__AVX512F__)` / `#elif defined(__AVX2__) && defined(__FMA__)` / `#else`):
  avx512   -march=native on a CPU with AVX-512 (x86-64-v4); bf16 GEMM by AVX-512 BF16 where
           the CPU has it, else by widening bf16 to fp32 in registers; int8-activation linear
           layers of 10+ rows by AMX tiles where the CPU has AMX-INT8 and Linux grants it, the
           same bits (quant_dot.c; the amx setting, set_amx, turns it off)
  avx2     -march=x86-64-v3 (AVX2 + FMA, 8 lanes), bf16 widened to fp32 on load
  generic  the compiler's baseline target and GCC vector extensions (x86-64 SSE2, aarch64
           NEON, anything else)
kernels/cpu_kernels.py's `select_isa` makes one tier the process's (the worker does, from its cpu_isa
argument; `auto` is the best tier this CPU runs). Each tier is batch-
invariant on its own, and the tiers give the same bits (every fused multiply-add is vec.h's, the
instruction or libm's fmaf, and -ffp-contract=off fuses nothing else), except bf16 GEMM on AVX-512
BF16 (k in pairs).

A library is built on first use with the system C compiler into the kernel_cache_dir setting's
folder (WorkerConfig; the worker passes it with `set_build_dir`, default ~/.cache/pagedserve-kernels),
keyed by a hash of the sources, the flags, the compiler and the CPU (processes that need the same
library at once wait on a file lock for the first to build it). kernels/cpu_kernels.py loads it and
wraps its entry points; its OpenMP calls land in the libgomp that torch has already loaded, so it
shares torch's threads.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from services.core.config import DEFAULT_KERNEL_CACHE_DIR

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_attention.c", "elementwise.c", "gemm.c", "decoder.c", "quant_gemm.c",
                                    "quant_dot.c", "quant_amx.c", "row_parallel.c", "scratch.c", "moe.c")]  # one library
COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=gnu11", "-Wno-psabi", "-ffp-contract=off"]  # no implicit fusion: vec.h's fma
TIERS = ("avx512", "avx2", "generic")  # best first; services.core.config.CPU_ISAS is ("auto", *TIERS)
# the test tiers that stand for older AVX-512 CPUs leave out quant_dot.c's AMX path (their CPUs have no AMX),
# so that on an AMX host they still run the VNNI / vpmaddubsw tiles they test
NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
TIER_FLAGS = {
    "avx512": ["-march=native"],  # only selected on a CPU with AVX-512, so native has it
    "avx2": ["-march=x86-64-v3"],
    "generic": [],  # the compiler's baseline target
    # tests only: the AVX-512 tier as built on an AVX-512 CPU without AVX-512 BF16 (nor AMX, which came later)
    "avx512-nobf16": ["-march=native", "-mno-avx512bf16", *NO_AMX],
    # tests only: AVX-512 without VNNI (quant_dot.c's vpmaddubsw path on an AVX-512 CPU)
    "avx512-novnni": ["-march=native", "-mno-avx512vnni", "-mno-avx512bf16", *NO_AMX],
}
# what each x86 tier needs from /proc/cpuinfo (x86-64-v3; v4 adds AVX-512 F/BW/CD/DQ/VL)
_X86_V3 = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


class KernelUnavailable(RuntimeError):
    """No C compiler, or the build failed: the caller falls back to the PyTorch reference."""


# ---- tiers -------------------------------------------------------------------------------
def host_tiers() -> tuple[str, ...]:
    """The tiers this CPU executes, best first (generic: every CPU)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    flags = set(_cpu_flags().split())
    tiers = [name for name, needs in (("avx512", _X86_V4), ("avx2", _X86_V3)) if needs <= flags]
    return (*tiers, "generic")


def testable_tiers() -> tuple[str, ...]:
    """The tiers the tests run here: every host tier, plus the AVX-512 tier without AVX-512 BF16
    where the CPU has it (the same library another AVX-512 CPU builds)."""
    tiers = host_tiers()
    if "avx512" in tiers and "avx512_bf16" in _cpu_flags().split():
        tiers = (tiers[0], "avx512-nobf16", *tiers[1:])
    return tiers


# ---- the build ---------------------------------------------------------------------------
def compile_sources(compiler: str, flags: list[str], output: str, sources: list[Path] | None = None,
                    libraries: tuple[str, ...] = ()) -> None:
    """cc COMMON_FLAGS flags -o output sources libraries; KernelUnavailable with the compiler's
    message on failure. (Also the cross-compiled checks': tests/kernels/aarch64.py.)"""
    with tempfile.TemporaryDirectory(prefix="pagedserve-objects-") as folder:
        objects = compile_objects(compiler, flags, sources or SOURCES, Path(folder))
        _run_compiler([compiler, *COMMON_FLAGS, *flags, "-o", output, *objects, *libraries])


def compile_objects(compiler: str, flags: list[str], sources: list[Path], folder: Path) -> list[str]:
    """Each source its own object in folder, as many at once as there are CPUs (quant_gemm.c alone is two
    thirds of a tier's build): the objects' paths, in the sources' order."""
    objects = [str(folder / f"{index}-{Path(source).stem}.o") for index, source in enumerate(sources)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(_run_compiler, [compiler, *COMMON_FLAGS, *flags, "-c", str(source), "-o", target])
                     for source, target in zip(sources, objects)]:
            done.result()
    return objects


def _run_compiler(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelUnavailable(f"{command[0]} failed: {result.stderr.strip()[:2000]}")


def build(tier: str = "avx512", build_dir: Path | None = None) -> Path:
    """The tier's shared library, compiled if this machine has not built these sources yet."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc) on PATH")
    flags = [*TIER_FLAGS[tier], "-shared"]
    folder = build_dir or _default_build_dir()
    target = folder / f"cpu_kernels-{tier}-{_build_key(compiler, flags)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with built_once(target):  # another process building the same library: wait for it, then reuse it
        if not target.exists():
            fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            try:
                compile_sources(compiler, flags, partial)
            except KernelUnavailable:
                os.unlink(partial)
                raise
            os.replace(partial, target)
    return target


@contextmanager
def built_once(target: Path) -> Iterator[None]:
    """Hold target's build lock (a file lock beside it): processes building the same file wait for the
    first and then reuse its file, the workers of one host and the tests' background pre-build alike.
    The block checks for target again and writes it beside, renamed into place."""
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


_build_dir = DEFAULT_KERNEL_CACHE_DIR  # WorkerConfig.kernel_cache_dir, given by the worker (set_build_dir)


def set_build_dir(folder: str) -> None:
    """Where the libraries are compiled to and reused from (the kernel_cache_dir setting)."""
    global _build_dir
    _build_dir = folder


def _default_build_dir() -> Path:
    home = Path(_build_dir).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pagedserve-kernels-{os.getuid()}"


def _build_key(compiler: str, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(CSRC.iterdir()) if path.is_file()))
    for part in (" ".join(COMMON_FLAGS + flags), version, platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """-march=native compiles for this CPU: a library built on another must not be reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
