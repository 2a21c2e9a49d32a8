"""Placement by cached prefix against round-robin: a multi-turn chat workload on 2 workers.

    python bench/placement.py [--conversations 16] [--turns 6] [--workers 2] [--num-gpu-blocks 512]

The real scheduler core (services/core: admission, placement, each worker's block manager and
prefix cache, its steps) drives stand-in workers on a simulated clock, so the figures depend on
neither the host's load nor a model: a stand-in's step takes STEP_BASE_S plus PREFILL_S per prompt
token it computes plus DECODE_S per sequence (a CPU worker's shape at a tiny model: prefill
dominates), and it samples a token derived from the sequence's length. Each worker steps on its
own clock, as the service's step loops do. A conversation's turn k+1 is turn k's prompt and answer
plus a new user message; it arrives THINK_S after turn k's last token.

Compared: the scheduler's placement (the worker that holds the longest cached prefix, ties by
load) and round-robin (each new or recomputed sequence on the next worker in turn). Reported per
policy: the prefix-cache hit rate (prompt tokens found / looked up, from the block managers), and
TTFT (arrival to first token) mean and p90 on the simulated clock. Writes
bench/results/placement.{md,json}.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, markdown_table, write_results  # noqa: E402
from services.core.config import SchedulerConfig  # noqa: E402
from services.core.sampling_params import SamplingParams  # noqa: E402
from services.core.scheduler import Scheduler  # noqa: E402
from services.core.step import SeqOutput, StepDelta, StepResult, WorkerInfo  # noqa: E402

STEP_BASE_S, PREFILL_S, DECODE_S, THINK_S = 0.004, 0.0004, 0.0005, 0.5
BLOCK_SIZE, VOCAB = 16, 32000


class RoundRobin(Scheduler):
    """The same scheduler placing each waiting sequence on the next worker in turn."""

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self._turn = itertools.count()

    def _place(self, seq):
        ids = sorted(self.workers)
        ws = self.workers[ids[next(self._turn) % len(ids)]]
        seq.placed = ws.worker_id
        ws.num_waiting += 1
        return ws


class StandIn:
    """Mirrors sequence lengths; a step's cost on the simulated clock and its sampled tokens."""

    def __init__(self):
        self.lengths: dict[int, int] = {}

    def step(self, delta: StepDelta) -> tuple[StepResult, float]:
        for seq_id in delta.finished_seq_ids:
            self.lengths.pop(seq_id, None)
        for new in delta.new_seqs:
            self.lengths[new.seq_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for cached in delta.cached_seqs:
            self.lengths[cached.seq_id] += len(cached.new_token_ids)
        result, cost = StepResult(delta.step_id), STEP_BASE_S
        for seq in delta.new_seqs + delta.cached_seqs:
            length = self.lengths[seq.seq_id]
            if seq.num_computed_tokens + seq.num_scheduled_tokens == length:
                result.outputs.append(SeqOutput(seq_id=seq.seq_id, token_ids=[3 + (length * 7919) % (VOCAB - 3)]))
                cost += DECODE_S if seq.num_scheduled_tokens == 1 else PREFILL_S * seq.num_scheduled_tokens
            else:
                cost += PREFILL_S * seq.num_scheduled_tokens
        return result, cost


def run(policy: type[Scheduler], args: argparse.Namespace) -> dict:
    config = SchedulerConfig(block_size=BLOCK_SIZE, max_model_len=8192, async_scheduling=False, seed=0)
    sched = policy(config)
    info = WorkerInfo(model="stand-in", dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks=args.num_gpu_blocks,
                      num_cpu_blocks=0, vocab_size=VOCAB, max_model_len=8192, eos_token_ids=(2,), device="cpu",
                      batch_invariant=True)
    workers = {f"w{i}": StandIn() for i in range(args.workers)}
    for worker_id in workers:
        sched.add_worker(worker_id, info)
    rng = random.Random(args.seed)
    history = {c: [rng.randrange(3, VOCAB) for _ in range(args.system_tokens)] for c in range(args.conversations)}
    turns_done = dict.fromkeys(history, 0)
    arrivals: dict[str, float] = {}
    ttft: list[float] = []
    events = [(rng.uniform(0, THINK_S), 0, "arrive", c) for c in history]  # (time, tie, kind, what)
    heapq.heapify(events)
    tie = itertools.count(1)
    busy: set[str] = set()

    def start_idle(now: float) -> None:
        for worker_id in workers:
            if worker_id not in busy:
                delta = sched.schedule_worker(worker_id)
                if delta is not None:
                    result, cost = workers[worker_id].step(delta)
                    busy.add(worker_id)
                    heapq.heappush(events, (now + cost, next(tie), "done", (worker_id, result)))

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            history[what] += [rng.randrange(3, VOCAB) for _ in range(args.user_tokens)]
            request_id = f"c{what}t{turns_done[what]}"
            arrivals[request_id] = now
            sched.add_request(request_id, history[what], SamplingParams(temperature=0, max_tokens=args.answer_tokens,
                                                                        ignore_eos=True))
        else:
            worker_id, result = what
            busy.discard(worker_id)
            for update in sched.update(worker_id, result):
                conversation = int(update.request_id[1:].split("t")[0])
                if update.request_id in arrivals and update.token_ids:
                    ttft.append(now - arrivals.pop(update.request_id))
                history[conversation] += update.token_ids
                if update.finish_reason:
                    turns_done[conversation] += 1
                    if turns_done[conversation] < args.turns:
                        heapq.heappush(events, (now + THINK_S, next(tie), "arrive", conversation))
        start_idle(now)
    stats = sched.stats().workers
    queries, hits = sum(w.prefix_cache_queries for w in stats), sum(w.prefix_cache_hits for w in stats)
    ttft.sort()
    return {"placement": "round-robin" if policy is RoundRobin else "prefix-aware",
            "prefix_hit_rate": hits / max(queries, 1), "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))], "requests": len(ttft), "sim_seconds": now}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=256, help="each conversation's first prompt")
    parser.add_argument("--user-tokens", type=int, default=48, help="each turn's new user message")
    parser.add_argument("--answer-tokens", type=int, default=64, help="each turn's answer")
    parser.add_argument("--num-gpu-blocks", type=int, default=512, help="per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="placement", help="results file stem in bench/results")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    rows = [run(policy, args) for policy in (Scheduler, RoundRobin)]
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    table = markdown_table(["placement", "prefix hit rate", "TTFT mean (ms)", "TTFT p90 (ms)", "requests"],
                           [[r["placement"], f"{r['prefix_hit_rate']:.3f}", f"{r['ttft_mean_ms']:.1f}",
                             f"{r['ttft_p90_ms']:.1f}", r["requests"]] for r in rows])
    notes = (f"{args.conversations} conversations x {args.turns} turns on {args.workers} workers "
             f"({args.num_gpu_blocks} KV blocks of {BLOCK_SIZE} each); simulated clock (step {STEP_BASE_S * 1e3:g} ms "
             f"+ {PREFILL_S * 1e3:g} ms per prefill token + {DECODE_S * 1e3:g} ms per decoding sequence), so the "
             "figures do not depend on the host's load.")
    write_results(args.out, "Placement by cached prefix against round-robin", load_before,
                  "\n" + table + "\n" + notes + "\n", {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
