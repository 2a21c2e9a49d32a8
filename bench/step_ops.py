"""What torch itself runs in an engine step, with torch held to AVX2 and without: per decode step
(and one prefill step) the main thread's CPU time and the ATen ops' self time, by op.

    python bench/step_ops.py                                # the avx2 tier, bf16, batch 1 and 16
    python bench/step_ops.py --cpu-isa avx512 --dtype float32 --batch-sizes 1,16,64

The engine's own kernels (kernels/csrc) do the linear layers, attention and the row-wise ops;
what is left to torch in a step is the embedding lookup, the logits' dtype conversion, small
index and tensor-creation ops around the sampler. Capping torch (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, as bench/common.py does for a forced
avx2 tier) swaps those ops' kernels; this measures whether that matters. Each capability runs in
a child process of its own (the caps are read when the libraries load), with one thread
(torch.set_num_threads(1)): thread CPU time measures the work, not the neighbours, on a shared
host. Per point: --steps decode steps timed one by one (min and median of the thread time),
then --profiled steps under torch.profiler (ATen self CPU time per step, the top ops), and
the prefill step of the same requests. Writes bench/results/step_ops.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import LIBRARY_ISA_ENV, loadavg, markdown_table, write_results  # noqa: E402
from workload import model_folder  # noqa: E402

CAPS = {"native": {}, "avx2": LIBRARY_ISA_ENV["avx2"]}
TOP = 6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--cpu-isa", default="avx2", help="the engine's kernel tier (auto, avx512, avx2, generic)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed one by one")
    parser.add_argument("--profiled", type=int, default=4, help="decode steps under torch.profiler")
    parser.add_argument("--caps", default="native,avx2", help="library caps to compare: native, avx2")
    parser.add_argument("--out", default="step_ops")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one cap, JSON out
    return parser.parse_args()


def _ops(prof, steps: int) -> dict:
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3  # ms per step
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP]
    return {"aten_self_ms": total, "top": [(e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps)
                                           for e in top]}


def run_child(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kernels import cpu_kernels
    from pagedserve import LLM, SamplingParams
    torch.set_num_threads(1)
    tier = cpu_kernels.select_isa(args.cpu_isa)
    points = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        steps = args.steps + args.profiled + 4
        llm = LLM(str(model_folder(args.model)), dtype=args.dtype, quantization="none", cpu_isa=tier,
                  max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.context),
                  enable_prefix_caching=False)
        rng = random.Random(batch)
        vocab = llm.tokenizer.vocab_size

        def add(tag: str) -> None:
            for i in range(batch):
                prompt = [rng.randrange(16, vocab) for _ in range(args.context)]
                llm.scheduler.add_request(f"{tag}{i}", prompt,
                                          SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))

        add("warm")  # a first pass: first-call costs out of the way
        for _ in range(steps + 1):
            llm.engine.step()
        add("timed")
        start = time.thread_time()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.engine.step()  # the prefill of every request
        prefill = {"thread_ms": 1e3 * (time.thread_time() - start), **_ops(prof, 1)}
        llm.engine.step()
        times = []
        for _ in range(args.steps):
            start = time.thread_time()
            llm.engine.step()
            times.append(1e3 * (time.thread_time() - start))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled):
                llm.engine.step()
        points.append({"batch": batch, "decode_thread_ms_min": min(times),
                       "decode_thread_ms_median": statistics.median(times), "decode": _ops(prof, args.profiled),
                       "prefill": prefill})
        del llm
    print(json.dumps({"tier": tier, "capability": torch.backends.cpu.get_cpu_capability(), "points": points}))


def main() -> None:
    args = parse_args()
    if args.child is not None:
        run_child(args)
        return
    from kernels import cpu_kernels
    cpu_kernels.select_isa(args.cpu_isa)  # the tier the results' header names (the children select it too)
    load_before = loadavg()
    results = {}
    for cap in args.caps.split(","):
        env = {k: v for k, v in os.environ.items() if k not in LIBRARY_ISA_ENV["avx2"]}
        env.update(CAPS[cap])
        command = [sys.executable, str(Path(__file__).resolve()), "--child", cap, *sys.argv[1:]]
        out = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
        results[cap] = json.loads(out.strip().splitlines()[-1])
        print(cap, json.dumps(results[cap]), flush=True)
    rows = []
    for cap, result in results.items():
        for point in result["points"]:
            for phase in ("decode", "prefill"):
                ops = point[phase]
                thread = (f"{point['decode_thread_ms_min']:.2f} (median {point['decode_thread_ms_median']:.2f})"
                          if phase == "decode" else f"{ops['thread_ms']:.1f}")
                top = ", ".join(f"{name[6:]} {ms:.3f} ({count})" for name, ms, count in ops["top"])
                rows.append([f"{cap} ({result['capability']})", point["batch"], phase, thread,
                             f"{ops['aten_self_ms']:.3f}", top])
    tier = next(iter(results.values()))["tier"] if results else "?"
    body = (f"Kernel tier {tier}, {args.dtype}, context {args.context}, 1 thread; per step: the main thread's CPU "
            f"time (decode: min and median of {args.steps} steps) and the ATen ops' self CPU time "
            f"(torch.profiler over {args.profiled} decode steps, or the one prefill step), top {TOP} ops as "
            "ms per step (calls per step).\n\n"
            + markdown_table(["torch capability", "batch", "step", "thread ms", "ATen ms", "top ATen ops"], rows))
    path = write_results(args.out, "The torch ops of an engine step, capped to AVX2 and not", load_before, body,
                         {"args": {k: v for k, v in vars(args).items() if k != "child"}, "results": results})
    print(path.read_text())


if __name__ == "__main__":
    main()
