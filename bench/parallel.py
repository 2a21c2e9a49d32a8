"""Tensor and pipeline parallel worker groups: what each layout costs, and what the fixed reduction costs.

    .venv/bin/python bench/parallel.py                                  # default model, 1x1, 3x1, 1x2
    .venv/bin/python bench/parallel.py --layouts 1x1,2x1,1x2,2x2 --model PATH --batch-tokens 32

1. The row-parallel layers' fixed reduction at TP=1 against today's kernel: o_proj and down_proj
   of the model's shapes as one linear layer (one chain over K, gemm.c) and as G fp32 partials
   folded in order (kernels/row_parallel.py), interleaved, median of --repeats.
2. Per layout (TPxPP): decode tok/s at batch 1 and batch 16 (output tokens over the generate
   call's wall time, prefill included), RSS per rank after the run, and rank 0's time in the
   group's collectives and sends/receives per engine step (waiting for a slower peer included).

The ranks of a group share this machine's cores (cores / ranks threads each), so on a 2-core
machine a group is not expected to be faster than one process; the claims are the same bits at
every layout (tests/e2e/test_parallel.py) and about 1/TP of the weights per rank. On a machine
with more cores or sockets the same script shows what the layouts buy there.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.common import loadavg, markdown_table, write_results  # noqa: E402
from kernels.linear import prepack  # noqa: E402
from kernels.row_parallel import RowParallelWeight, split_dense  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from services.core.model_path import resolve_model_path  # noqa: E402
from services.worker.model_config import ModelArchConfig  # noqa: E402
from services.worker.parallel import total_groups  # noqa: E402


def reduction_cost(cfg: ModelArchConfig, repeats: int) -> list[list]:
    """(layer, dtype, batch, today's us, fixed reduction us, ratio) for o_proj and down_proj, one thread
    (the kernels' bits do not depend on it; on a shared machine two threads stall at OpenMP's barriers),
    the fastest of --repeats interleaved rounds (the least disturbed by the host's other load)."""
    groups = total_groups(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shapes = {"o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for name, (out_features, in_features) in shapes.items():
            dense = torch.randn(out_features, in_features, generator=gen).to(dtype)
            plain = prepack(dense)
            grouped = RowParallelWeight.build([prepack(p) for p in split_dense(dense, groups)], groups)
            for batch in (1, 16):
                x = torch.randn(batch, in_features, generator=gen).to(dtype)
                times = {"plain": [], "grouped": []}
                for _ in range(repeats):  # interleaved: the host's load drifts alike for both
                    for label, weight in (("plain", plain), ("grouped", grouped)):
                        start = time.perf_counter()
                        for _ in range(20):
                            weight(x, None)
                        times[label].append((time.perf_counter() - start) / 20 * 1e6)
                today, fixed = min(times["plain"]), min(times["grouped"])
                rows.append([name, str(dtype).removeprefix("torch."), batch, today, fixed, fixed / today])
    torch.set_num_threads(threads)
    return rows


def layout_row(model: str, tp: int, pp: int, tokens: int) -> dict:
    prompts = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
               "Explain why the sky is blue."]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_memory_bytes=128 << 20) as llm:
        worker = next(iter(llm.engine.workers.values()))
        steps = {"n": 0}
        step = llm.engine.step

        def counted():
            steps["n"] += 1
            return step()

        llm.engine.step = counted
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (first calls compile nothing, but fault pages in)
        out = {}
        for batch in (1, 16):
            comm0 = worker.comm.comm_seconds if worker.comm else 0.0
            steps["n"] = 0
            start = time.perf_counter()
            outputs = llm.generate([prompts[i % len(prompts)] for i in range(batch)], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            produced = sum(len(o.outputs[0].token_ids) for o in outputs)
            comm = (worker.comm.comm_seconds - comm0) if worker.comm else 0.0
            out[batch] = (produced / seconds, comm / max(steps["n"], 1) * 1e3)
        processes = [psutil.Process()] + [psutil.Process(p.pid) for p in worker.followers]
        rss = [p.memory_info().rss / 2**20 for p in processes]
    gc.collect()
    return {"layout": f"{tp}x{pp}", "tok_s_1": out[1][0], "tok_s_16": out[16][0], "comm_ms_1": out[1][1],
            "comm_ms_16": out[16][1], "rss_mib": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--layouts", default="1x1,3x1,1x2", help="TPxPP, comma-separated")
    parser.add_argument("--batch-tokens", type=int, default=24, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    load_before = loadavg()
    model = str(resolve_model_path(args.model))
    cfg = ModelArchConfig.from_folder(model)
    reduction = reduction_cost(cfg, args.repeats)
    layouts = []
    for spec in args.layouts.split(","):
        tp, pp = (int(v) for v in spec.lower().split("x"))
        layouts.append(layout_row(model, tp, pp, args.batch_tokens))
        print(layouts[-1], flush=True)
    body = "\n".join([
        f"Model {model}: {total_groups(cfg)} row-parallel K groups (dense weights). Threads: "
        f"{os.cpu_count()} cores shared by a group's ranks (cores / ranks each).", "",
        "**No speed-up is claimed on this machine**: its 2 cores are split across the ranks, and it was shared "
        "with other developers' jobs while this ran (load average above). The claims are the same bits at every "
        "layout (tests/e2e/test_parallel.py) and about 1/TP of the weights per rank.", "",
        "## The fixed reduction at TP=1 against today's kernel (one linear layer, 1 thread, fastest round)", "",
        markdown_table(["layer", "dtype", "batch", "today us", "fixed reduction us", "ratio"], reduction),
        "## Layouts (TPxPP): decode tok/s, rank 0's communication per step, RSS per rank", "",
        markdown_table(["layout", "tok/s batch 1", "tok/s batch 16", "comm ms/step b1", "comm ms/step b16",
                        "RSS MiB per rank (rank 0 holds the scheduler and tokenizer too)"],
                       [[r["layout"], r["tok_s_1"], r["tok_s_16"], r["comm_ms_1"], r["comm_ms_16"],
                         ", ".join(f"{v:.0f}" for v in r["rss_mib"])] for r in layouts]),
    ])
    path = write_results("parallel", "Tensor and pipeline parallel worker groups", load_before, body,
                         {"reduction": reduction, "layouts": layouts})
    print(path.read_text())


if __name__ == "__main__":
    main()
