"""Times each Triton kernel against its PyTorch reference and against the bytes-moved floor.

Sizes are Llama-3.2-1B-shaped (32 query heads, 8 KV heads, head_dim 64, hidden 2048,
intermediate 8192), batch 1 to 256, context 128 to 4096, bf16, block size 16. The floor
of a kernel is the bytes it must read and write divided by the copy bandwidth measured on
the same device (a large device-to-device copy), so "x floor" says how far a kernel is
from memory-bound speed. Each case also records the max error against the reference.

    python bench/kernel_bench.py --out bench/results/gpu_check.md     # on a CUDA machine
    TRITON_INTERPRET=1 python bench/kernel_bench.py --smoke --out /tmp/smoke.md   # CPU: pipeline check

Importing this module imports neither triton nor the kernels; main() does.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 32, 8, 64, 2048, 8192  # Llama-3.2-1B
BLOCK_SIZE = 16
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [128, 512, 1024, 2048, 4096]
PREFILLS = [(1, 512), (1, 2048), (4, 512), (8, 256)]  # (sequences, prompt tokens each)
TOKENS = [1, 64, 256, 2048]  # rows for the row-wise kernels (decode batch .. prefill chunk)


@dataclass
class Result:
    kernel: str
    case: str
    bytes_moved: int
    triton_us: float
    reference_us: float
    floor_us: float
    max_abs_err: float
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.reference_us / self.triton_us

    @property
    def x_floor(self) -> float:
        return self.triton_us / self.floor_us


# ---- sizes and bytes (CPU-safe) ----

def attention_bytes(seqs: list[tuple[int, int]], elsize: int) -> int:
    """q in, out back, each sequence's K and V read once per KV head (the floor), tables."""
    tokens = sum(n for _, n in seqs)
    kv = sum(ctx for ctx, _ in seqs) * KV_HEADS * HEAD_DIM * 2 * elsize
    tables = sum(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs) * 4
    return 2 * tokens * HEADS * HEAD_DIM * elsize + kv + tables


def attention_cases(smoke: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(context, queries)]) decode grid, then prefill chunks."""
    if smoke:
        return [("decode b=2 ctx=130", [(130, 1)] * 2), ("prefill 1x20", [(20, 20)])]
    cases = [(f"decode b={b} ctx={c}", [(c, 1)] * b) for b in BATCHES for c in CONTEXTS]
    cases += [(f"prefill {s}x{n}", [(n, n)] * s) for s, n in PREFILLS]
    return cases


def row_cases(smoke: bool) -> list[int]:
    return [3] if smoke else TOKENS


# ---- timing ----

def time_us(fn: Callable[[], object], device: str) -> float:
    """Median microseconds per call: triton's do_bench on CUDA, a short wall-clock loop on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (counts read + write), the floor's yardstick."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_us(lambda: dst.copy_(src), device) * 1e-6)


def max_err(a, b) -> float:
    if isinstance(a, tuple):
        return max(max_err(x, y) for x, y in zip(a, b) if x is not None)
    return (a.float() - b.float()).abs().max().item()


# ---- cases ----

def paged_batch(seqs: list[tuple[int, int]], dtype: torch.dtype, device: str) -> dict:
    blocks = [-(-ctx // BLOCK_SIZE) for ctx, _ in seqs]
    num_blocks = sum(blocks)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    ids = torch.randperm(num_blocks, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = ids[start:start + n]
        start += n
    num_queries = torch.tensor([n for _, n in seqs])
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return dict(
        q=torch.randn(int(num_queries.sum()), HEADS, HEAD_DIM, dtype=dtype, device=device),
        k_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        v_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], device=device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), num_queries.cumsum(0)]).to(device),
        scale=HEAD_DIM ** -0.5,
    )


def bench_pair(kernel: str, case: str, nbytes: int, triton_fn, ref_fn, bandwidth: float, device: str) -> Result:
    err = max_err(triton_fn(), ref_fn())
    return Result(kernel, case, nbytes, time_us(triton_fn, device), time_us(ref_fn, device),
                  nbytes / bandwidth * 1e6, err)


def bench_attention(ops_t, ops_r, dtype, device, bandwidth, smoke) -> list[Result]:
    from kernels.attention import token_layout

    results = []
    for name, seqs in attention_cases(smoke):
        batch = paged_batch(seqs, dtype, device)
        batch["layout"] = token_layout(batch["seq_lens"], batch["query_start_loc"])  # once per step, as the worker
        nbytes = attention_bytes(seqs, batch["q"].element_size())
        results.append(bench_pair("paged_attention", name, nbytes, lambda b=batch: ops_t.paged_attention(**b),
                                  lambda b=batch: ops_r.paged_attention(**b), bandwidth, device))
    return results


def bench_rows(ops_t, ops_r, dtype, device, bandwidth, smoke) -> list[Result]:
    """write_kv, rms_norm (with residual), apply_rotary, silu_and_mul at decode..prefill row counts."""
    from kernels.rotary import cos_sin_cache

    results, el = [], torch.tensor([], dtype=dtype).element_size()
    rotary_cache = cos_sin_cache(HEAD_DIM, 8192, 500000.0).to(device)
    for t in row_cases(smoke):
        k, v = (torch.randn(t, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
        caches = [torch.randn(t // BLOCK_SIZE + 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
                  for _ in range(2)]
        caches += [c.clone() for c in caches]  # [0], [1] for triton; [2], [3] for the reference
        slots = torch.randperm(caches[0].shape[0] * BLOCK_SIZE, device=device)[:t]
        results.append(bench_pair("write_kv", f"T={t}", 4 * t * KV_HEADS * HEAD_DIM * el + 8 * t,
                                  lambda: (ops_t.write_kv(k, v, caches[0], caches[1], slots), *caches[:2])[1:],
                                  lambda: (ops_r.write_kv(k, v, caches[2], caches[3], slots), *caches[2:])[1:],
                                  bandwidth, device))
        x, res = (torch.randn(t, HIDDEN, dtype=dtype, device=device) for _ in range(2))
        w = torch.randn(HIDDEN, dtype=dtype, device=device)
        results.append(bench_pair("rms_norm+residual", f"T={t} N={HIDDEN}", (4 * t + 1) * HIDDEN * el,
                                  lambda: ops_t.rms_norm(x, w, 1e-5, res), lambda: ops_r.rms_norm(x, w, 1e-5, res),
                                  bandwidth, device))
        q = torch.randn(t, HEADS, HEAD_DIM, dtype=dtype, device=device)
        pos = torch.randint(0, 8192, (t,), device=device)
        rot_bytes = 2 * t * (HEADS + KV_HEADS) * HEAD_DIM * el + t * (8 + HEAD_DIM * 4)
        results.append(bench_pair("apply_rotary", f"T={t}", rot_bytes, lambda: ops_t.apply_rotary(q, k, pos, rotary_cache),
                                  lambda: ops_r.apply_rotary(q, k, pos, rotary_cache), bandwidth, device))
        gate_up = torch.randn(t, 2 * INTER, dtype=dtype, device=device)
        results.append(bench_pair("silu_and_mul", f"T={t} I={INTER}", 3 * t * INTER * el,
                                  lambda: ops_t.silu_and_mul(gate_up), lambda: ops_r.silu_and_mul(gate_up),
                                  bandwidth, device))
    return results


# ---- report ----

def environment(device: str) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, device=device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       check=False).stdout.strip()
    except OSError:
        pass
    return env


def render_markdown(results: list[Result], env: dict, bandwidth: float, command: str, tests: str) -> str:
    lines = ["# GPU check: Triton kernels", "", f"Command: `{command}`", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             f"Copy bandwidth (floor yardstick): {bandwidth / 1e9:.0f} GB/s", ""]
    if tests:
        lines += ["## Kernel tests on the device", "", "```", tests.strip(), "```", ""]
    lines += ["## Timings (median)", "",
              "| kernel | case | MB moved | triton us | reference us | speedup | floor us | x floor | max abs err |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.kernel} | {r.case} | {r.bytes_moved / 1e6:.2f} | {r.triton_us:.1f} | {r.reference_us:.1f}"
                     f" | {r.speedup:.1f} | {r.floor_us:.1f} | {r.x_floor:.1f} | {r.max_abs_err:.2e} |")
    raw = [dict(asdict(r), speedup=r.speedup, x_floor=r.x_floor) for r in results]
    lines += ["", "## Raw", "", "```json", json.dumps(dict(env=env, copy_bandwidth=bandwidth, results=raw), indent=1),
              "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/gpu_check.md")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--tests-log", help="pytest output to embed in the report")
    parser.add_argument("--only", choices=["attention", "rows"], help="one family of kernels")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs here (under TRITON_INTERPRET=1)")
    from kernels.ops import TORCH_OPS
    from kernels.triton_ops import TRITON_OPS

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 24))
    results = []
    if args.only in (None, "rows"):
        results += bench_rows(TRITON_OPS, TORCH_OPS, dtype, device, bandwidth, args.smoke)
    if args.only in (None, "attention"):
        results += bench_attention(TRITON_OPS, TORCH_OPS, dtype, device, bandwidth, args.smoke)
    tests = Path(args.tests_log).read_text()[-4000:] if args.tests_log else ""
    command = "python bench/kernel_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(render_markdown(results, environment(device), bandwidth, command, tests))
    for r in results:
        print(f"{r.kernel:18s} {r.case:22s} triton {r.triton_us:9.1f} us  ref {r.reference_us:9.1f} us"
              f"  x floor {r.x_floor:6.1f}  err {r.max_abs_err:.2e}", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
