"""Per-type speed of the quantized linear kernels: weight bytes read per second, each GGUF type against
Q4_0 (the first type whose int8-activation kernel was tuned: rows interleaved at load, VNNI / vpmaddubsw tiles;
Q2_K .. Q6_K, IQ4_XS, IQ4_NL, Q5_0 and Q5_1 now take the same tiles).

    python bench/kquant_speed.py --threads 1 --rounds 5 --cpu-time
    python bench/kquant_speed.py --types q4_0,q4_k,q6_k --batches 1,512 --activations int8 --cpu-isa avx2

One linear layer per (shape, type, batch, activations) on the Llama-3.2-1B shapes (2048 x 2048: q/o_proj,
8192 x 2048: gate/up, 2048 x 8192: down), the weights as the loader makes them (QuantWeight.
with_activations: every type interleaved for int8 activations), random valid blocks
(tests/kernels/quant_helpers.random_blocks: the bits depend on them, the time barely). Cases interleaved
round by round (every case once per round), median of --rounds, each round the mean of --calls calls.
Reports microseconds a call, weight GB/s (the type's own bytes) and that rate as a fraction of Q4_0's
on the same shape, batch and activations ("x Q4_0 GB/s": 1.0 reads the type's bytes as fast as Q4_0's).
--cpu-time times in this process's CPU seconds (with --threads 1: the kernel's own cost on a loaded
host, not the bandwidth it would reach alone). Writes bench/results/<--out>.{md,json} with the CPU,
tier, threads and the load average before and after.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import add_cpu_isa, loadavg, markdown_table, select_tier, write_results  # noqa: E402

SHAPES = {"qo 2048x2048": (2048, 2048), "gate/up 8192x2048": (8192, 2048), "down 2048x8192": (2048, 8192)}


def weight_of(name: str, n: int, k: int, int8: bool):
    """[n, k] of valid random blocks of GGUF type `name`, as the loader prepares it for the activations."""
    from kernels import quant
    from tests.kernels.quant_helpers import random_blocks

    data = random_blocks(name, n, k, np.random.default_rng(0))
    return quant.from_blocks(data, quant.FORMATS[name], k, torch.float32).with_activations(int8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k,q5_k,q3_k,q2_k,iq4_xs,iq4_nl,q5_0,q5_1")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--activations", default="int8,fp32", help="int8 (quant_dot.c) and/or fp32 (quant_gemm.c)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls timed per round (their mean)")
    parser.add_argument("--cpu-time", action="store_true", help="time in process CPU seconds, not wall seconds")
    parser.add_argument("--out", default="kquant_speed")
    add_cpu_isa(parser)
    args = parser.parse_args()
    args.cpu_isa = select_tier(args.cpu_isa, args.libraries_isa)
    from kernels import cpu_kernels, quant

    torch.set_num_threads(args.threads)
    load_before = loadavg()
    lib = quant.declare(cpu_kernels.library())
    names, batches = args.types.split(","), [int(b) for b in args.batches.split(",")]
    shapes, kinds = args.shapes.split(","), args.activations.split(",")
    if "q4_0" not in names:
        names.insert(0, "q4_0")  # the yardstick
    weights = {(s, n, a): weight_of(n, *SHAPES[s], a == "int8") for s in shapes for n in names for a in kinds}
    inputs = {(s, m): torch.randn(m, SHAPES[s][1]) for s in shapes for m in batches}
    cases = [(s, a, m, n) for s in shapes for a in kinds for m in batches for n in names]
    clock = time.process_time if args.cpu_time else time.perf_counter
    times: dict = {case: [] for case in cases}
    for _ in range(args.rounds):  # interleaved: each round runs every case once
        for case in cases:
            s, a, m, n = case
            weight, x = weights[s, n, a], inputs[s, m]
            quant.run_kernel(lib, x, weight, None)  # warm
            start = clock()
            for _ in range(args.calls):
                quant.run_kernel(lib, x, weight, None)
            times[case].append((clock() - start) / args.calls)
    rows, data = [], []
    for s, a, m, n in cases:
        t = statistics.median(times[s, a, m, n])
        gbs = weights[s, n, a].data.numel() / t / 1e9
        base = weights[s, "q4_0", a].data.numel() / statistics.median(times[s, a, m, "q4_0"]) / 1e9
        data.append(dict(shape=s, activations=a, batch=m, type=n, us=t * 1e6, gb_per_s=gbs, vs_q4_0=gbs / base,
                         rounds_us=[v * 1e6 for v in times[s, a, m, n]]))
        rows.append([s, a, m, n, f"{t * 1e6:.0f}", f"{gbs:.2f}", f"{gbs / base:.2f}"])
    how = "process CPU seconds (--cpu-time)" if args.cpu_time else "wall seconds"
    body = (f"Timed in {how}; {args.threads} kernel thread(s); CPU kernel tier {cpu_kernels.active_tier()} "
            f"({cpu_kernels.compiled_path()}); median of {args.rounds} interleaved rounds of {args.calls} calls.\n\n"
            + markdown_table(["layer", "activations", "batch", "type", "us / call", "weight GB/s", "x Q4_0 GB/s"],
                             rows))
    path = write_results(args.out, "Quantized linear kernels per GGUF type: weight GB/s against Q4_0", load_before,
                         body, {"rows": data, "threads": args.threads, "cpu_time": args.cpu_time})
    print(path.read_text())


if __name__ == "__main__":
    main()
