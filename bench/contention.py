"""The in-process engine when other processes want the same cores: LLM.generate of 1 and 16
prompts x 48 greedy tokens, quiet and next to N busy-loop processes, under each OpenMP wait
policy.

    python bench/contention.py                                   # bf16; loads 0 and 2; default and PASSIVE
    python bench/contention.py --loads 0,1,2,4 --wait-policies default,passive,spin:10000 --rounds 3
    python bench/contention.py --cpu-isa avx2 --dtype bfloat16   # the AVX2 tier (libraries capped too)

Why: the kernels' threads are an OpenMP team (libgomp, shared with torch). Between parallel
regions its threads spin (default policy), so one descheduled team member stalls every region
until the scheduler brings it back; a decode step has ~10 regions per layer. In one ad-hoc
run on this 2-core host, bf16 batch-1 decode fell from 94 to 5.9 tok/s next to two busy
processes, and OMP_WAIT_POLICY=PASSIVE kept 35 but cost half the quiet speed.

A wait policy is read when libgomp starts, so each policy runs in a child process of its own
(this script with --child), which loads the engine once and then, round by round, times every
(load, batch size) point in turn: N background processes (`while True: pass`, started and
stopped by the child around each point), one untimed warm-up generate per batch size, then
the timed generate. Policies: default (unset), passive, active (OMP_WAIT_POLICY) or spin:N
(GOMP_SPINCOUNT=N: spin N iterations, then sleep). Prompts: --prompt-len random token ids
(seeded), the same for every point. tokens/s = output tokens / generate wall time; the median
over --rounds rounds is reported, with the range, and each point's ratio to the same policy's
quiet figure and to the default policy's quiet figure.
Writes bench/results/contention.{md,json}.
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

from common import add_cpu_isa, engine_tier_args, loadavg, markdown_table, select_tier, show_results  # noqa: E402
from workload import model_folder  # noqa: E402

BUSY_LOOP = "while True: pass"


def policy_env(policy: str) -> dict[str, str]:
    """The environment a wait policy's child runs under (on top of this process's, less both variables)."""
    if policy == "default":
        return {}
    if policy in ("passive", "active"):
        return {"OMP_WAIT_POLICY": policy.upper()}
    if policy.startswith("spin:") and policy[5:].isdigit():
        return {"GOMP_SPINCOUNT": policy[5:]}
    raise SystemExit(f"--wait-policies: {policy!r} is not default, passive, active or spin:N")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", help="the engine's weights (none: the dtype's)")
    parser.add_argument("--batch-sizes", default="1,16", help="prompts per generate call")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy output tokens per prompt")
    parser.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per prompt")
    parser.add_argument("--loads", default="0,2", help="background busy-loop processes at each point")
    parser.add_argument("--wait-policies", default="default,passive",
                        help="default, passive, active (OMP_WAIT_POLICY) or spin:N (GOMP_SPINCOUNT=N)")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes over every point, the median kept")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a policy's child may take")
    parser.add_argument("--out", default="contention")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one policy, print JSON
    add_cpu_isa(parser)
    return parser.parse_args()


def run_child(args: argparse.Namespace) -> None:
    """One wait policy (already in this process's environment): every point, round by round, as JSON."""
    import torch
    from pagedserve import LLM, SamplingParams
    select_tier(args.cpu_isa, args.libraries_isa)  # the caps were inherited: no restart
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    loads = [int(n) for n in args.loads.split(",")]
    llm = LLM(str(model_folder(args.model)), dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=max(batch_sizes), enable_prefix_caching=False, **engine_tier_args())
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    prompts = [[rng.randrange(16, vocab) for _ in range(args.prompt_len)] for _ in range(max(batch_sizes))]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in batch_sizes:  # untimed: first-call costs (allocations, page faults) out of the way
        llm.generate(prompts[:batch], [params] * batch, use_tqdm=False)
    points = []
    for round_index in range(args.rounds):
        for load in loads:
            busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(load)]
            try:
                time.sleep(0.5 if load else 0)  # the busy processes are running before the clock starts
                for batch in batch_sizes:
                    start = time.perf_counter()
                    outputs = llm.generate(prompts[:batch], [params] * batch, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                    points.append({"round": round_index, "load": load, "batch": batch, "tokens": tokens,
                                   "seconds": seconds, "tokens_per_s": tokens / seconds})
                    print(json.dumps(points[-1]), file=sys.stderr, flush=True)
            finally:
                for process in busy:  # only the ones this child started, by their handle
                    process.kill()
                    process.wait()
    print(json.dumps({"threads": torch.get_num_threads(), "points": points}))


def run_policy(policy: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(policy_env(policy))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", policy,
               *(arg for arg in sys.argv[1:] if arg != "--child")]
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise SystemExit(f"the {policy} child failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarize(results: dict[str, dict]) -> list[dict]:
    rows = []
    quiet = {}  # (policy, batch) -> median tok/s at load 0
    for policy, result in results.items():
        groups: dict[tuple[int, int], list[float]] = {}
        for point in result["points"]:
            groups.setdefault((point["load"], point["batch"]), []).append(point["tokens_per_s"])
        for (load, batch), values in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0])):
            median = statistics.median(values)
            if load == 0:
                quiet[(policy, batch)] = median
            rows.append({"policy": policy, "load": load, "batch": batch, "tokens_per_s": median,
                         "range": (min(values), max(values)), "threads": result["threads"]})
    default_policy = next(iter(results))
    for row in rows:
        own, first = quiet.get((row["policy"], row["batch"])), quiet.get((default_policy, row["batch"]))
        row["vs_own_quiet"] = row["tokens_per_s"] / own if own else None
        row["vs_first_policy_quiet"] = row["tokens_per_s"] / first if first else None
    return rows


def main() -> None:
    args = parse_args()
    if args.child is not None:
        run_child(args)
        return
    policies = args.wait_policies.split(",")
    for policy in policies:
        policy_env(policy)  # a bad name fails before any engine loads
    select_tier(args.cpu_isa, args.libraries_isa)  # may restart this process with the libraries capped
    load_before = loadavg()
    results = {}
    for policy in policies:
        print(f"wait policy {policy} ...", flush=True)
        results[policy] = run_policy(policy, args)
    rows = summarize(results)
    first = policies[0]
    table = [[r["policy"], r["batch"], r["load"], f"{r['tokens_per_s']:.1f}",
              "{:.1f}-{:.1f}".format(*r["range"]),
              f"{r['vs_own_quiet']:.2f}x" if r["vs_own_quiet"] else "n/a",
              f"{r['vs_first_policy_quiet']:.2f}x" if r["vs_first_policy_quiet"] else "n/a"] for r in rows]
    body = (f"LLM.generate of B prompts ({args.prompt_len} random tokens) x {args.max_tokens} greedy tokens, "
            f"{args.dtype}, quantization {args.quantization}, {rows[0]['threads'] if rows else '?'} threads, "
            f"next to `load` busy-loop processes on this machine's {os.cpu_count()} CPUs; median of "
            f"{args.rounds} rounds (range). Each policy in its own process.\n\n"
            + markdown_table(["wait policy", "batch", "busy processes", "tok/s", "range",
                              "vs the policy quiet", f"vs {first} quiet"], table))
    show_results(args.out, "Contention: the engine next to other CPU-bound processes", load_before, body,
                 {"args": {k: v for k, v in vars(args).items() if k != "child"}, "rows": rows,
                  "raw": results})


if __name__ == "__main__":
    main()
