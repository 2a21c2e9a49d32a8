"""Tensor and pipeline parallel worker groups: what each layout costs, and what the fixed reduction costs.

    .venv/bin/python bench/parallel.py                                  # default model, 1x1, 3x1, 1x2
    .venv/bin/python bench/parallel.py --layouts 1x1,2x1,1x2,2x2 --model PATH --batch-tokens 32

1. The row-parallel layers' fixed reduction at TP=1: o_proj and down_proj of the model's shapes as
   one linear layer (one chain over K, gemm.c), as G fp32 partials folded in order, and as the
   one-pass fold TP=1 runs now (kernels/row_parallel.py), interleaved, fastest of --repeats.
2. Per layout (TPxPP): decode tok/s at batch 1 and batch 16 (output tokens over the generate
   call's wall time, prefill included), RSS per rank after the run, and rank 0's time in the
   group's collectives and sends/receives per engine step (waiting for a slower peer included).
3. The pipeline bubble at PP in --bubble-pp, batch 16: each stage's compute over the pipelined
   passes' wall time, one micro-batch a step (stage after stage) against as many as stages.

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

from bench.common import loadavg, markdown_table, show_results  # noqa: E402
from kernels.linear import prepack  # noqa: E402
from kernels.row_parallel import RowParallelWeight, split_dense  # noqa: E402
from kernels.row_parallel import library as row_parallel_library  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from services.core.model_path import resolve_model_path  # noqa: E402
from services.worker.model_config import ModelArchConfig  # noqa: E402
from services.worker.parallel import total_groups  # noqa: E402


def reduction_cost(cfg: ModelArchConfig, repeats: int) -> list[list]:
    """(layer, dtype, batch, one chain us, partials + fold us, one pass us, ratios) for o_proj and down_proj,
    one thread (the kernels' bits do not depend on it; on a shared machine two threads stall at OpenMP's
    barriers), the fastest of --repeats interleaved rounds (the least disturbed by the host's other load).
    One chain: a plain linear layer (gemm.c), not layout-invariant. Partials + fold: G fp32 partials and
    their fold, two calls (what a rank of a TP > 1 group runs, and what TP=1 ran before the one-pass fold).
    One pass: TP=1 now (row_parallel_linear: each group's chain folded into a running total in registers)."""
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
            for batch in (1, 16, 128):
                x = torch.randn(batch, in_features, generator=gen).to(dtype)
                contenders = _kernel_calls(plain, grouped, x)
                times = {label: [] for label in contenders}
                for _ in range(repeats):  # interleaved: the host's load drifts alike for all
                    for label, run in contenders.items():
                        start = time.perf_counter()
                        for _ in range(20):
                            run()
                        times[label].append((time.perf_counter() - start) / 20 * 1e6)
                plain_us, partials_us, one_us = (min(times[label]) for label in contenders)
                rows.append([name, str(dtype).removeprefix("torch."), batch, plain_us, partials_us, one_us,
                             partials_us / plain_us, one_us / plain_us, one_us / partials_us])
    torch.set_num_threads(threads)
    return rows


def _kernel_calls(plain, grouped: RowParallelWeight, x: torch.Tensor) -> dict:
    """The three contenders as the C calls alone (ctypes, buffers allocated once): what the decoder stack runs."""
    lib = row_parallel_library()
    m, k = x.shape
    n, groups, bf16 = grouped.out_features, grouped.groups, int(x.dtype == torch.bfloat16)
    out, partials = torch.empty(m, n, dtype=x.dtype), torch.empty(groups, m, n)
    args = (x.data_ptr(), k, grouped.buffer.data_ptr(), 0, groups, m, n, k // groups, bf16)

    def chain():
        lib.linear(x.data_ptr(), k, plain.packed.data_ptr(), None, out.data_ptr(), n, m, n, k, bf16, 1)

    def partials_fold():
        lib.row_parallel_partials(*args, partials.data_ptr(), 1, None)
        lib.fold_partials(partials.data_ptr(), groups, m, n, out.data_ptr(), n, bf16, 1)

    def one_pass():
        lib.row_parallel_linear(*args, out.data_ptr(), n, None, 1, None)

    return {"chain": chain, "partials": partials_fold, "one_pass": one_pass}


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
        processes = [psutil.Process()] + [psutil.Process(p.pid) for p in getattr(worker, "followers", [])]
        rss = [p.memory_info().rss / 2**20 for p in processes]
    gc.collect()
    return {"layout": f"{tp}x{pp}", "tok_s_1": out[1][0], "tok_s_16": out[16][0], "comm_ms_1": out[1][1],
            "comm_ms_16": out[16][1], "rss_mib": rss}


def bubble_rows(model: str, pp: int, micro_batches: int, tokens: int) -> dict:
    """PP=pp, batch 16, `micro_batches` a step: each stage's compute (embedding, layers, final norm) over
    rank 0's pipelined passes' wall time (services/worker/pipeline.py timers; sampling and scheduling not
    counted in either), and decode tok/s over the generate call."""
    prompts = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
               "Explain why the sky is blue."]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(model, pipeline_parallel_size=pp, pipeline_micro_batches=micro_batches,
             kv_cache_memory_bytes=128 << 20) as llm:
        worker = next(iter(llm.engine.workers.values()))
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        before = worker.group_timers()
        start = time.perf_counter()
        outputs = llm.generate([prompts[i % len(prompts)] for i in range(16)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = worker.group_timers()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    wall = after[0]["forward_seconds"] - before[0]["forward_seconds"]
    busy = [(a["busy_seconds"] - b["busy_seconds"]) / wall for a, b in zip(after, before)]
    gc.collect()
    return {"pp": pp, "micro_batches": micro_batches, "tok_s_16": produced / seconds, "forward_s": wall,
            "busy_share": busy}


def bubble(model: str, pps: list[int], tokens: int, rounds: int) -> list[dict]:
    """One micro-batch (stage after stage) against as many as stages, interleaved round by round."""
    rows = []
    for _ in range(rounds):
        for pp in pps:
            for micro_batches in (1, pp):
                rows.append(bubble_rows(model, pp, micro_batches, tokens))
                print(rows[-1], flush=True)
    return rows


def bubble_table(rows: list[dict]) -> str:
    """The rounds' mean per (pp, micro-batches)."""
    keys = list(dict.fromkeys((r["pp"], r["micro_batches"]) for r in rows))
    table = []
    for pp, mb in keys:
        mine = [r for r in rows if (r["pp"], r["micro_batches"]) == (pp, mb)]
        share = [sum(r["busy_share"][s] for r in mine) / len(mine) for s in range(pp)]
        table.append([pp, mb, len(mine), sum(r["tok_s_16"] for r in mine) / len(mine),
                      sum(r["forward_s"] for r in mine) / len(mine), ", ".join(f"{v:.2f}" for v in share),
                      f"{1 - sum(share) / pp:.2f}"])
    return markdown_table(["PP", "micro-batches", "rounds", "tok/s batch 16", "pipelined passes s",
                           "busy share per stage (0..PP-1)", "bubble (1 - mean share)"], table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--layouts", default="1x1,3x1,1x2", help="TPxPP, comma-separated")
    parser.add_argument("--batch-tokens", type=int, default=24, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--bubble-pp", default="2,4",
                        help="PP sizes whose bubble is measured at batch 16 (empty: none)")
    parser.add_argument("--bubble-rounds", type=int, default=2)
    args = parser.parse_args()
    load_before = loadavg()
    model = str(resolve_model_path(args.model))
    cfg = ModelArchConfig.from_model(model)  # a folder, or a GGUF file (the default model)
    reduction = reduction_cost(cfg, args.repeats)
    layouts = []
    for spec in filter(None, args.layouts.split(",")):
        tp, pp = (int(v) for v in spec.lower().split("x"))
        layouts.append(layout_row(model, tp, pp, args.batch_tokens))
        print(layouts[-1], flush=True)
    pps = [int(v) for v in args.bubble_pp.split(",") if v]
    bubbles = bubble(model, pps, args.batch_tokens, args.bubble_rounds) if pps else []
    body = "\n".join([
        f"Model {model}: {total_groups(cfg)} row-parallel K groups (dense weights). Threads: "
        f"{os.cpu_count()} cores shared by a group's ranks (cores / ranks each).", "",
        "**No speed-up is claimed on this machine**: its 2 cores are split across the ranks, and it was shared "
        "with other developers' jobs while this ran (load average above). The claims are the same bits at every "
        "layout (tests/e2e/test_parallel.py) and about 1/TP of the weights per rank.", "",
        "## The fixed reduction at TP=1 (one linear layer, 1 thread, fastest round, the C calls alone)", "",
        "One chain: a plain linear layer (not layout-invariant). Partials + fold: G fp32 partials, then their "
        "fold (TP=1 before the one-pass fold; a rank of a TP > 1 group still). One pass: TP=1 now, the same "
        "bits as partials + fold (tests/kernels/test_row_parallel.py). Timed as the C calls alone through ctypes "
        "(about 1 us a call; partials + fold is two calls), buffers allocated once, as the model's decoder stack "
        "runs them.", "",
        markdown_table(["layer", "dtype", "batch", "one chain us", "partials + fold us", "one pass us",
                        "partials / chain", "one pass / chain", "one pass / partials"], reduction),
        "## Layouts (TPxPP): decode tok/s, rank 0's communication per step, RSS per rank", "",
        markdown_table(["layout", "tok/s batch 1", "tok/s batch 16", "comm ms/step b1", "comm ms/step b16",
                        "RSS MiB per rank (rank 0 holds the scheduler and tokenizer too)"],
                       [[r["layout"], r["tok_s_1"], r["tok_s_16"], r["comm_ms_1"], r["comm_ms_16"],
                         ", ".join(f"{v:.0f}" for v in r["rss_mib"])] for r in layouts]),
        "## Pipeline bubble: one micro-batch a step against as many as stages (batch 16)", "",
        "Busy share: a stage's compute (embedding, its layers, the final norm) over rank 0's pipelined passes' "
        "wall time; the rest of the pass that stage waited (its bubble). Sampling and scheduling are outside "
        "both. On this 2-core host the stages' processes share 2 cores, so overlapping stages compete for them: "
        "**no speed-up is claimed here**; the figures show the schedule (how much of the pass each stage "
        "works), which is what a machine with a core set per stage turns into throughput. Where stages overlap on "
        "shared cores each one computes slower, so a busy share there also counts time its process waited for a "
        "core: read the shares as an upper bound of the work overlapped, and the tok/s as what this host gave.", "",
        bubble_table(bubbles) if bubbles else "(not run: --bubble-pp empty)\n",
        "## Shared-memory transport within one host: not tried", "",
        "Not built yet (issue 26 item 5): gloo over loopback is the only transport. A shared-memory path is to be kept "
        "only if this script shows it faster; on a 2-core host the collectives' time is mostly ranks waiting for a "
        "core (rank 0's comm ms/step above), not copying bytes, so it could not show that here.",
    ])
    show_results("parallel", "Tensor and pipeline parallel worker groups", load_before, body,
                 {"reduction": reduction, "layouts": layouts, "bubble": bubbles})


if __name__ == "__main__":
    main()
