"""The row-parallel layers (o_proj, down_proj) with int8 activations: row_parallel_linear's one pass
(quant_dot.c's quant_linear_int8_groups: each tile's K groups folded in registers, one parallel region)
against the partials and their fold (row_parallel_partials + fold_partials: a rank's path, and the one
process's path where the one pass refuses a format: G calls, an fp32 [G, m, n] buffer, one more region).

    python bench/row_parallel_speed.py --threads 1 --rounds 5 --cpu-time
    python bench/row_parallel_speed.py --types q4_k,q6_k,q4_0 --batches 1,16,512 --paths one-pass --threads 2

On the Llama-3.2-1B shapes with the model's G = 8 K groups (o_proj 2048 x 2048: groups of 256; down_proj
2048 x 8192: groups of 1024), each type's weights as the loader makes them (random valid blocks, interleaved
for int8 activations, cut into the groups by split_quant). Cases interleaved round by round, median of
--rounds, each round the mean of --calls calls. Both paths give the same bits (tests/kernels/
test_row_parallel.py); this measures only their time. To compare two builds, run the script from each
checkout in turn (each builds its own library: the build cache is keyed by the sources). Writes
bench/results/<--out>.{md,json} with the CPU, tier, threads and the load average before and after.
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

SHAPES = {"o_proj 2048x2048": (2048, 2048), "down 2048x8192": (2048, 8192)}
PATHS = ("one-pass", "partials+fold")


def layer_of(name: str, n: int, k: int, groups: int):
    """[n, k] of valid random blocks of GGUF type `name` for int8 activations, as `groups` K groups."""
    from kernels import quant
    from kernels.row_parallel import RowParallelWeight, split_quant
    from tests.kernels.quant_helpers import random_blocks

    data = random_blocks(name, n, k, np.random.default_rng(0))
    weight = quant.from_blocks(data, quant.FORMATS[name], k, torch.float32).with_activations(True)
    return RowParallelWeight.build(split_quant(weight, groups), groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="q4_k,q6_k,q4_0")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--batches", default="1,16,512")
    parser.add_argument("--paths", default=",".join(PATHS), help="of " + ", ".join(PATHS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls timed per round (their mean)")
    parser.add_argument("--cpu-time", action="store_true", help="time in process CPU seconds, not wall seconds")
    parser.add_argument("--out", default="row_parallel_speed")
    add_cpu_isa(parser)
    args = parser.parse_args()
    args.cpu_isa = select_tier(args.cpu_isa, args.libraries_isa)
    from kernels import cpu_kernels

    torch.set_num_threads(args.threads)
    load_before = loadavg()
    names, batches = args.types.split(","), [int(b) for b in args.batches.split(",")]
    shapes, paths = args.shapes.split(","), args.paths.split(",")
    layers = {(s, n): layer_of(n, *SHAPES[s], args.groups) for s in shapes for n in names}
    inputs = {(s, m): torch.randn(m, SHAPES[s][1]) for s in shapes for m in batches}
    run = {"one-pass": lambda w, x: w(x, None), "partials+fold": lambda w, x: w.fold(w.partials(x), x.dtype)}
    cases = [(s, m, n, p) for s in shapes for m in batches for n in names for p in paths]
    clock = time.process_time if args.cpu_time else time.perf_counter
    times: dict = {case: [] for case in cases}
    for _ in range(args.rounds):  # interleaved: each round runs every case once
        for case in cases:
            s, m, n, p = case
            layer, x, call = layers[s, n], inputs[s, m], run[p]
            call(layer, x)  # warm
            start = clock()
            for _ in range(args.calls):
                call(layer, x)
            times[case].append((clock() - start) / args.calls)
    rows, data = [], []
    for s, m, n, p in cases:
        t = statistics.median(times[s, m, n, p])
        gbs = layers[s, n].buffer.numel() / t / 1e9
        data.append(dict(shape=s, batch=m, type=n, path=p, us=t * 1e6, gb_per_s=gbs,
                         rounds_us=[v * 1e6 for v in times[s, m, n, p]]))
        rows.append([s, m, n, p, f"{t * 1e6:.0f}", f"{gbs:.2f}", f"{m / t:.0f}"])
    how = "process CPU seconds (--cpu-time)" if args.cpu_time else "wall seconds"
    body = (f"Timed in {how}; {args.threads} kernel thread(s); G = {args.groups}; CPU kernel tier "
            f"{cpu_kernels.active_tier()} ({cpu_kernels.compiled_path()}); median of {args.rounds} interleaved rounds "
            f"of {args.calls} calls.\n\n"
            + markdown_table(["layer", "batch", "type", "path", "us / call", "weight GB/s", "rows / s"], rows))
    path = write_results(args.out, "Row-parallel layers with int8 activations: one pass against partials + fold",
                         load_before, body, {"rows": data, "threads": args.threads, "cpu_time": args.cpu_time,
                                             "groups": args.groups})
    print(path.read_text())


if __name__ == "__main__":
    main()
