"""The CPU kernel tiers side by side: one decode step's linear layers (every weight of the
model, in order) through the own GEMM of each tier this CPU executes, and its paged attention
(every layer, each sequence at --context keys), interleaved round by round, the best round kept.

Timed in thread CPU time with one thread, not wall time: on a shared host (load average
15-20 on 2 cores when this was written) wall time measures the neighbours, while one thread's
CPU time still measures the kernel, memory stalls included. GB/s = weight bytes / that time,
so batch 1 is the memory-bound decode case (the bandwidth floor is bytes / bandwidth).

    python bench/tiers.py [--model PATH] [--dtypes float32,bfloat16] [--batch-sizes 1,16] [--rounds 8]
                          [--kernels linear,attention] [--context 300]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import loadavg, markdown_table, write_results  # noqa: E402
from kernels import build, cpu_kernels  # noqa: E402
from kernels.cpu_kernels import paged_attention_cpu  # noqa: E402
from kernels.linear import invariant_linear, prepack  # noqa: E402
from linear_bound import step_shapes  # noqa: E402
from runners import DTYPES  # noqa: E402
from services.worker.model_config import ModelArchConfig  # noqa: E402
from workload import model_folder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kernels", default="linear,attention")
    parser.add_argument("--context", type=int, default=300, help="keys each sequence attends to (attention)")
    parser.add_argument("--out", default="tiers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = loadavg()
    shapes = step_shapes(model_folder(args.model))
    tiers = build.testable_tiers()
    paths = {}
    for tier in tiers:
        with cpu_kernels.use_isa(tier):
            paths[tier] = cpu_kernels.compiled_path()
    kernels = args.kernels.split(",")
    sections, data = [], {}
    if "linear" in kernels:
        text, data["linear"] = linear_section(args, shapes, tiers, paths)
        sections.append(text)
    if "attention" in kernels:
        text, data["attention"] = attention_section(args, model_folder(args.model), tiers, paths)
        sections.append(text)
    path = write_results(args.out, "CPU kernel tiers: the kernels of a decode step", load_before,
                         "\n\n".join(sections), data)
    print(path.read_text())


def best_times(tiers, rounds: int, run) -> dict[str, float]:
    """Each tier's best thread CPU time for run() over rounds + 1 rounds, tiers interleaved round
    by round (the first round also builds and warms every tier; being slowest, it is not the best)."""
    best = {}
    for _ in range(rounds + 1):
        for tier in tiers:
            with cpu_kernels.use_isa(tier):
                start = time.thread_time()
                run()
                best[tier] = min(best.get(tier, float("inf")), time.thread_time() - start)
    return best


def add_rows(rows: list, data: list, tiers, paths, best: dict[str, float], num_bytes: int, ms_format: str,
             **point) -> None:
    """One table row and one JSON record per tier for a measured point (dtype, batch, ...)."""
    for tier in tiers:
        seconds = best[tier]
        rows.append([point["dtype"], point["batch"], tier, paths[tier], ms_format.format(seconds * 1e3),
                     f"{num_bytes / seconds / 1e9:.1f}", f"{best[tiers[0]] / seconds:.2f}x"])
        data.append(dict(**point, tier=tier, path=paths[tier], seconds=seconds, gb_per_s=num_bytes / seconds))
    print(rows[-len(tiers):], flush=True)


def linear_section(args, shapes, tiers, paths) -> tuple[str, list[dict]]:
    rows, data = [], []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        weights = [prepack(torch.randn(n, k).to(dtype) / k ** 0.5, "gemm") for n, k in shapes]  # one layout, all tiers
        num_bytes = sum(n * k * torch.empty(0, dtype=dtype).element_size() for n, k in shapes)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            inputs = {k: torch.randn(batch, k).to(dtype) for k in {k for _, k in shapes}}

            def step():
                for weight, (_, k) in zip(weights, shapes):
                    invariant_linear(inputs[k], weight, None)

            best = best_times(tiers, args.rounds, step)
            add_rows(rows, data, tiers, paths, best, num_bytes, "{:.1f}", dtype=name, batch=batch)
    return ("## The linear layers\n\n"
            "One decode step's linear layers per kernel tier, 1 thread, thread CPU time, best of "
            f"{args.rounds} interleaved rounds (weights: {num_bytes / 1e6:.0f} MB in bf16 or fp32 as the row says).\n\n"
            + markdown_table(["dtype", "batch", "tier", "code path", "ms", "GB/s", f"speed vs {tiers[0]}"], rows)), data


def attention_section(args, folder: Path, tiers, paths) -> tuple[str, list[dict]]:
    """Every layer's paged attention of one decode step: `batch` sequences at args.context keys,
    one query each, the model's heads, 16-token blocks spread over the cache."""
    arch = ModelArchConfig.from_folder(folder)
    heads, kv_heads, head_dim, layers = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.num_layers
    block_size, context = 16, args.context
    rows, data = [], []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            blocks = -(-context // block_size)
            k_cache = torch.randn(batch * blocks, block_size, kv_heads, head_dim).to(dtype)
            step = dict(q=torch.randn(batch, heads, head_dim).to(dtype), k_cache=k_cache,
                        v_cache=torch.randn_like(k_cache),
                        block_tables=torch.randperm(batch * blocks).view(batch, blocks),
                        seq_lens=torch.full((batch,), context), query_start_loc=torch.arange(batch + 1),
                        scale=head_dim ** -0.5)
            num_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size() * layers  # keys + values
            best = best_times(tiers, args.rounds, lambda: [paged_attention_cpu(**step) for _ in range(layers)])
            add_rows(rows, data, tiers, paths, best, num_bytes, "{:.2f}", dtype=name, batch=batch, context=context)
    return ("## Paged attention\n\n"
            f"One decode step's paged attention ({layers} layers, {heads} query heads, {kv_heads} KV heads of "
            f"{head_dim}), each sequence one query at {context} keys, per kernel tier, 1 thread, thread CPU time, "
            f"best of {args.rounds} interleaved rounds; GB/s = KV-cache bytes read / time.\n\n"
            + markdown_table(["dtype", "batch", "tier", "code path", "ms", "GB/s", f"speed vs {tiers[0]}"], rows)), data


if __name__ == "__main__":
    main()
