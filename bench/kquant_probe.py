"""A probe, not a benchmark: one int8-activation linear layer per GGUF type on the Llama-3.2-1B shapes
(gate/up: 8192 x 2048, down: 2048 x 8192), batch 1 (decode) and 16, timed on the active CPU tier.
The K-quants' and Q4_0 / Q8_0's kernels side by side, interleaved round by round, median of --rounds.

    python bench/kquant_probe.py --threads 1 --rounds 5

The weights are random valid blocks (tests/kernels/quant_helpers.random_blocks); the bits do not
depend on them, the time barely. Prints a markdown table: microseconds a call, and weight GB/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"gate/up": (8192, 2048), "down": (2048, 8192)}  # (out_features, in_features)


def weight_of(name: str, n: int, k: int):
    from kernels import quant
    from tests.kernels.quant_helpers import random_blocks

    data = random_blocks(name, n, k, np.random.default_rng(0))
    return quant.from_blocks(data, quant.FORMATS[name], k, torch.bfloat16).with_activations(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="calls timed per round (their mean)")
    args = parser.parse_args()
    from kernels import cpu_kernels, quant

    torch.set_num_threads(args.threads)
    lib = quant.declare(cpu_kernels.library())
    names, batches = args.types.split(","), [int(b) for b in args.batches.split(",")]
    cases = [(shape, name, m) for shape in SHAPES for m in batches for name in names]
    weights = {(shape, name): weight_of(name, *SHAPES[shape]) for shape in SHAPES for name in names}
    inputs = {(shape, m): torch.randn(m, SHAPES[shape][1]).to(torch.bfloat16) for shape in SHAPES for m in batches}
    times: dict = {case: [] for case in cases}
    for _ in range(args.rounds):  # interleaved: each round runs every case once
        for shape, name, m in cases:
            weight, x = weights[shape, name], inputs[shape, m]
            quant.run_kernel(lib, x, weight, None)  # warm
            start = time.perf_counter()
            for _ in range(args.calls):
                quant.run_kernel(lib, x, weight, None)
            times[shape, name, m].append((time.perf_counter() - start) / args.calls)
    print(f"tier {cpu_kernels.active_tier()}, {args.threads} thread(s), median of {args.rounds} rounds\n")
    print("| layer | batch | type | us / call | weight GB/s |\n|---|---|---|---|---|")
    for shape, name, m in cases:
        t = statistics.median(times[shape, name, m])
        print(f"| {shape} | {m} | {name} | {t * 1e6:.0f} | {weights[shape, name].data.numel() / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
