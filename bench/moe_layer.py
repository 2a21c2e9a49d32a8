"""One mixture-of-experts layer's step time (services/worker/models/moe.py, MoE.forward) at a few tokens a step:
a step's experts in one call per projection (quant_dot.c's quant_experts_int8, where the experts take int8
activations) against each expert's own calls, in one process on the same weights and rows.

    python bench/moe_layer.py MODEL.gguf --threads 2 --tokens 1,4,16 --rounds 5 --out moe_layer

MODEL: a GGUF file or folder of a mixture (e.g. the Qwen3-MoE 3B-active shape of bench/results/
qwen3moe_a3b_speed.md), loaded as the engine loads it (--quantization, --activation-quant). Layer 0's MoE
runs on random rows (seed 0); the two paths are interleaved round by round, each round the mean of --calls
steps, the median of --rounds reported, with this process's CPU time beside the wall time (2 threads on a
loaded host: the CPU time shows the threads' spinning at the regions' joins). The two paths' outputs are
checked bit for bit first. Writes bench/results/<--out>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import loadavg, markdown_table, show_results  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file or a model folder of a mixture of experts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,4,16", help="tokens a step, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50, help="steps a round (each round's figure: their mean)")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--activation-quant", default="int8")
    parser.add_argument("--out", default="moe_layer")
    return parser.parse_args()


def timed(moe, x: torch.Tensor, calls: int) -> tuple[float, float]:
    """ms a step: wall, and this process's CPU time."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        moe(x)
    return (time.perf_counter() - wall) / calls * 1e3, (time.process_time() - cpu) / calls * 1e3


def main() -> None:
    from pagedserve import LLM
    from services.worker.models import moe as moe_module

    args = parse_args()
    load_before = loadavg()
    llm = LLM(args.model, seed=0, enable_prefix_caching=False, quantization=args.quantization, dtype="float32",
              num_threads=args.threads, activation_quant=args.activation_quant, num_gpu_blocks=64)
    moe = llm.engine.workers["worker-0"].runner.model.layers[0].mlp
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = torch.randn(max(tokens), moe.router_weight.shape[1], generator=torch.Generator().manual_seed(0)) * 0.5
    moe(rows)  # the experts' tables, built at the first step
    one_call = moe._tables
    paths = {"each expert's own calls": moe_module._ExpertTables(gate_up=None, down=None), "one call": one_call}
    table, data = [], {"threads": args.threads, "tokens": tokens, "rounds": args.rounds, "calls": args.calls,
                       "one_call": {"gate_up": one_call.gate_up is not None, "down": one_call.down is not None},
                       "results": {}}
    for count in tokens:
        x = rows[:count]
        outs = []
        for tables in paths.values():
            moe._tables = tables
            outs.append(moe(x))
        assert torch.equal(outs[0], outs[1]), "the one call's bits differ from the experts' own calls'"
        figures = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, tables in paths.items():
                moe._tables = tables
                figures[name].append(timed(moe, x, args.calls))
        base = statistics.median(w for w, _ in figures["each expert's own calls"])
        for name, values in figures.items():
            wall, cpu = statistics.median(w for w, _ in values), statistics.median(c for _, c in values)
            table.append([count, name, round(wall, 3), round(cpu, 3), f"{base / wall:.2f}x"])
            data["results"][f"{count}/{name}"] = {"wall_ms": [w for w, _ in values], "cpu_ms": [c for _, c in values]}
    moe._tables = one_call
    body = (f"Layer 0's MoE of {args.model} ({args.quantization}, {args.activation_quant} activations), "
            f"{args.threads} threads; one call runs gate_up: {one_call.gate_up is not None}, down_proj: "
            f"{one_call.down is not None}. Median of {args.rounds} rounds of {args.calls} steps.\n\n")
    body += markdown_table(["tokens", "path", "ms a step (wall)", "ms a step (CPU)", "vs own calls"], table)
    show_results(args.out, "A mixture-of-experts layer's step", load_before, body, data)


if __name__ == "__main__":
    main()
