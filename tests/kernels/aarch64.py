"""The kernels cross-compiled for aarch64 (static, run under qemu-user), built once per -march and
machine: test_cross_arch.py, test_quant_types.py and test_quant_dot_aarch64.py link their harness
(tests/kernels/csrc) to the same archive, and the suite's background pre-build (tests/prebuild.py) makes
it while the tests before them run. A cross build of quant_gemm.c and quant_dot.c takes minutes of CPU:
built per module, it was the suite's largest fixed cost."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from kernels import build

CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
CROSS_AR = "aarch64-linux-gnu-ar"
HARNESSES = Path(__file__).with_name("csrc")
MISSING = (None if shutil.which(CROSS_CC) and shutil.which(CROSS_AR) and shutil.which(QEMU) else
           f"needs {CROSS_CC} and {QEMU} (apt-get install gcc-aarch64-linux-gnu qemu-user)")
MARCHES = ("armv8-a", "armv8.2-a+dotprod")  # the baseline NEON build; with the dot-product extension (sdot)


def _flags(march: str) -> list[str]:
    return ["-static", f"-march={march}", f"-I{build.CSRC}"]


def kernel_archive(march: str = "armv8-a") -> Path:
    """Every kernel source compiled for aarch64 at `march` (kernels/build.py's flags, -Wall clean), as a static
    archive in the kernel cache folder, built if this machine has not built these sources yet."""
    version = subprocess.run([CROSS_CC, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(build.CSRC.iterdir())
                                     if path.is_file()))
    digest.update(" ".join([*build.COMMON_FLAGS, *_flags(march), version]).encode())
    folder = build._default_build_dir()
    target = folder / f"aarch64-{march}-{digest.hexdigest()[:16]}.a"
    with build.built_once(target):
        if not target.exists():
            with tempfile.TemporaryDirectory(prefix="pagedserve-aarch64-") as scratch:
                objects = build.compile_objects(CROSS_CC, [*_flags(march), "-Wall", "-Werror"],
                                                      build.SOURCES, Path(scratch))
                partial = Path(scratch) / "kernels.a"
                subprocess.run([CROSS_AR, "rcs", str(partial), *objects], check=True, capture_output=True)
                shutil.move(str(partial), f"{target}.partial")
            Path(f"{target}.partial").replace(target)
    return target


def check_executable(harness: str, exe: Path, march: str = "armv8-a") -> Path:
    """tests/kernels/csrc/<harness> linked with the kernels for aarch64 at `march`, as exe."""
    build.compile_sources(CROSS_CC, _flags(march), str(exe), [HARNESSES / harness],
                                (str(kernel_archive(march)), "-lm"))
    return exe


def run(exe: Path, blob: bytes, folder: Path) -> tuple[str, bytes]:
    """exe under qemu on the input blob: (its stdout, its output file's bytes)."""
    (folder / "in.bin").write_bytes(blob)
    done = subprocess.run([QEMU, str(exe), str(folder / "in.bin"), str(folder / "out.bin")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout, (folder / "out.bin").read_bytes()
