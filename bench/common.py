"""What every benchmark records next to its figures: the command, the machine, the load, the versions."""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


_TIER = {"cpu_isa": "auto"}  # what add_cpu_isa's flag asked for


# What a lower tier holds the libraries to (ATen's own kernels, oneDNN, MKL): the whole process then
# runs as it would on a CPU of that tier, so a forced tier's contenders (transformers included)
# are compared as on that CPU, not the engine alone held back while torch keeps AVX-512.
LIBRARY_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def add_cpu_isa(parser) -> None:
    parser.add_argument("--cpu-isa", default="auto", help="CPU kernel tier: auto, avx512, avx2 or generic")
    parser.add_argument("--libraries-isa", choices=("tier", "native"), default="tier",
                        help="tier (default): with --cpu-isa avx2 or generic, hold torch, oneDNN and MKL to the "
                             "same instruction set (the process restarts itself with ATEN_CPU_CAPABILITY, "
                             "ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS set), as on a CPU of that tier; "
                             "native: leave the libraries on everything this CPU has")


def library_isa() -> str:
    """The library caps this process runs under, for the results' header."""
    caps = [f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                      "MKL_ENABLE_INSTRUCTIONS") if name in os.environ]
    return ", ".join(caps) or "none (every instruction set this CPU has)"


def select_tier(isa: str, libraries: str = "tier") -> str:
    """Run this benchmark on one kernel tier: the engines it builds take engine_tier_args(), and
    the services it starts inherit PAGEDSERVE_CPU_ISA (read by the worker's main). With libraries
    "tier" a lower tier also caps the libraries (LIBRARY_ISA_ENV): they read their caps when they
    load, so the process starts itself again with them set (once; the services inherit them)."""
    caps = LIBRARY_ISA_ENV.get(isa, {}) if libraries == "tier" else {}
    if any(os.environ.get(name) != value for name, value in caps.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **caps})
    from kernels import cpu_kernels

    tier = cpu_kernels.select_isa(isa)
    _TIER["cpu_isa"] = tier
    os.environ["PAGEDSERVE_CPU_ISA"] = tier
    return tier


def engine_tier_args() -> dict:
    return {"cpu_isa": _TIER["cpu_isa"]}


def kernel_tier() -> str:
    """The tier the CPU kernels ran on, and the code path its build took (gemm.c's kernel_tier)."""
    from kernels import cpu_kernels

    if not cpu_kernels.is_available():
        return "none (no C compiler: PyTorch references)"
    return f"{cpu_kernels.active_tier()} ({cpu_kernels.compiled_path()})"


def machine() -> dict:
    import torch
    info = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "kernel_tier": kernel_tier(),
            "library_isa": library_isa(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        # "AMD EPYC" alone does not tell Zen 4 (family 25) from Zen 5 (family 26): RESULTS.md's table needs both
        info["cpu"] = fields.get("Model name", "n/a").strip() + "".join(
            f", {key.lower()} {fields[key].strip()}" for key in ("CPU family", "Model") if key in fields)
    except (OSError, subprocess.TimeoutExpired):
        info["cpu"] = "n/a"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "n/a"


def header(title: str, load_before: str) -> str:
    """The top of every results file: the command that made it, when, where, under what load."""
    m = machine()
    return "\n".join([
        f"# {title}", "",
        "```", command_line(), "```", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S')}, commit {git_commit()}",
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), torch {m['torch']} ({m['torch_threads']} threads), "
        f"transformers {m.get('transformers', 'n/a')}, Python {m['python']}",
        f"- CPU kernel tier: {m['kernel_tier']}; libraries capped: {library_isa()}",
        f"- load average (1/5/15 min): before {load_before}, after {loadavg()}"
        " — other processes on this machine make figures noisy when the 1-minute load is above ~0.5", "",
    ])


def write_results(stem: str, title: str, load_before: str, body: str, data: dict) -> Path:
    """bench/results/<stem>.md (header + body) and <stem>.json (data + the same context)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md = RESULTS_DIR / f"{stem}.md"
    md.write_text(header(title, load_before) + body.rstrip() + "\n")
    data = {"command": command_line(), "loadavg_before": load_before, "loadavg_after": loadavg(),
            "machine": machine(), "commit": git_commit(), **data}
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    return md


def show_results(stem: str, title: str, load_before: str, body: str, data: dict) -> Path:
    """write_results, then the markdown file on stdout: how a benchmark run ends."""
    path = write_results(stem, title, load_before, body, data)
    print(path.read_text())
    return path


def figure_path(stem: str) -> Path:
    """bench/results/<stem>.png, its folder made: where a benchmark's plot goes beside its results."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{stem}.png"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
