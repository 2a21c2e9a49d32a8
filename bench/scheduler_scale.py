"""One scheduler's capacity: the real scheduler service driving N stand-in workers over real gRPC.

    python bench/scheduler_scale.py [--workers 1,2,4,8,16,32] [--seqs-per-worker 8] [--seconds 4]
                                    [--rounds 2] [--profile N] [--compare TREE ...] [--step-ms MS]

The scheduler is the service itself, `python -m services.scheduler`, in a process of its own (a
fresh one per N), whose CPU time psutil reads. Each stand-in worker (StandInWorker) serves the
Worker gRPC contract (worker.proto: Step, GetInfo, and grpc.health.v1) and registers as a real one
does (services.worker.registrar.Registrar: RegisterWorker, then heartbeats); its Step answers at
once with a canned token for each sequence that reached the end of its tokens, so a step costs the
scheduler what a real one does and the worker almost nothing. A client on one SubmitMany call, as
a frontend's, keeps seqs-per-worker x N requests running (16-token prompts, ignore_eos, 4000
tokens: none ends during the window). The stand-ins and the client share this process.

Per N, over the window: steps/s (of the slowest worker; each worker steps at its own pace, its own
step loop in the scheduler), worker-steps/s, the scheduler's CPU time
per worker-step, its CPU use (1.0 = one core: its one event loop is saturated), this process's CPU
use (the stand-ins and the client: when it nears 1.0 they, not the scheduler, set the pace), and the
latency the scheduler adds per step as a worker sees it: from a worker's answer leaving until its
next Step arriving (p50, p99), which is the scheduler's turn plus two loopback hops. --profile N
runs the scheduler at N workers under cProfile and prints its top functions.

--step-ms MS makes each stand-in take MS milliseconds per step (asyncio.sleep: no CPU), as a
real worker's forward pass does: the scheduler is then measured below saturation, at the step
rate of N such workers, instead of at the most it can drive.

--compare TREE runs, beside this checkout's scheduler, the one of another checkout of the
repository (e.g. a git worktree of an older commit), interleaved: for each round and worker count
all are measured back to back, the order rotated each turn, so a change in the host's load hits
them alike; the figure compared is the median of the paired ratios (this / TREE). Repeat it to
compare with several checkouts in one run. The stand-ins and the client are this checkout's (they
serve both Step and StepStream, so a scheduler of either kind drives them).

Writes bench/results/scheduler_scale.{md,json,png}.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc loads: no transport notes at teardown
import grpc  # noqa: E402
import psutil  # noqa: E402
import uvloop  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, RESULTS_DIR, figure_path, loadavg, markdown_table, write_results  # noqa: E402
from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from services.core.sampling_params import SamplingParams  # noqa: E402
from services.core.step import WorkerInfo  # noqa: E402
from services.launch.deployment import free_ports  # noqa: E402
from services.launch.healthcheck import is_serving  # noqa: E402
from services.launch.logs import configure_logging  # noqa: E402
from services.rpc import internal_codec  # noqa: E402
from services.rpc.grpc_server import GrpcServer  # noqa: E402
from services.worker.registrar import Registrar  # noqa: E402
from services.worker.server import SERVICE_NAME  # noqa: E402

TOKEN = 7  # every stand-in samples this (ignore_eos: no request ends on it)
PROMPT_LEN, MAX_TOKENS = 16, 30000  # long enough that no request ends during a window
INFO = WorkerInfo(model="stand-in", dtype="float32", block_size=16, num_gpu_blocks=8192, num_cpu_blocks=0,
                  vocab_size=32000, max_model_len=32768, eos_token_ids=(2,), device="cpu", batch_invariant=True)


class StandInWorker(worker_pb2_grpc.WorkerServicer):
    """The worker's gRPC contract with no model: each step (Step or StepStream) is answered at once."""

    def __init__(self, worker_id: str, scheduler_address: str, step_s: float = 0.0):
        self.worker_id, self.scheduler_address, self.step_s = worker_id, scheduler_address, step_s
        self.grpc = GrpcServer(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(self, server),
                               SERVICE_NAME, reflection_on=False)
        self.lengths: dict[int, int] = {}  # seq_id -> tokens it has (prompt + output)
        self.num_steps = 0
        self.gaps: list[float] = []  # answer sent -> next Step in, seconds
        self.answered: float | None = None
        self.registration: asyncio.Task | None = None

    async def start(self) -> None:
        port = await self.grpc.start("127.0.0.1", 0)
        registrar = Registrar(self.scheduler_address, self.worker_id, f"127.0.0.1:{port}", INFO,
                              on_registered=lambda: self.grpc.set_serving(True),
                              on_forgotten=lambda: self.grpc.set_serving(False))
        self.registration = asyncio.create_task(registrar.run())

    async def stop(self) -> None:
        self.registration.cancel()
        await asyncio.gather(self.registration, return_exceptions=True)
        await self.grpc.stop(None)

    async def Step(self, request, context):
        """What a scheduler of an earlier version calls (--compare): a unary call a step."""
        return await self._answer(request, context)

    async def StepStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._answer(request, context)

    async def _answer(self, request, context) -> worker_pb2.StepResponse:
        arrived = time.perf_counter()
        if self.answered is not None:
            self.gaps.append(arrived - self.answered)
        for seq_id in request.finished_seq_ids:
            self.lengths.pop(seq_id, None)
        outputs = []
        for seq in request.new_seqs:
            total = self.lengths[seq.seq_id] = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            if seq.num_computed_tokens + seq.num_scheduled_tokens >= total:
                outputs.append(worker_pb2.SeqOutput(seq_id=seq.seq_id, token_ids=[TOKEN] * max(seq.num_samples, 1)))
        for seq in request.cached_seqs:
            if seq.seq_id not in self.lengths:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown sequence {seq.seq_id}")
            total = self.lengths[seq.seq_id] = self.lengths[seq.seq_id] + len(seq.new_token_ids)
            if seq.num_computed_tokens + seq.num_scheduled_tokens >= total:
                outputs.append(worker_pb2.SeqOutput(seq_id=seq.seq_id, token_ids=[TOKEN]))
        if self.step_s:
            await asyncio.sleep(self.step_s)  # a forward pass's time, not its CPU
        self.num_steps += 1
        self.answered = time.perf_counter()
        return worker_pb2.StepResponse(step_id=request.step_id, outputs=outputs)

    async def GetInfo(self, request, context):
        return internal_codec.info_to_proto(INFO)


class Load:
    """num_requests long requests on one SubmitMany call, as a frontend sends them; counts the news."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, num_requests: int):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        self.outbox: asyncio.Queue = asyncio.Queue()
        for i in range(num_requests):
            prompt = [3 + (i * 131 + j * 17) % 31000 for j in range(PROMPT_LEN)]  # no two alike: no prefix hits
            self.outbox.put_nowait(scheduler_pb2.SubmitManyRequest(
                submit=internal_codec.submit_to_proto(f"r{i}", prompt, params, 0)))
        self.call = stub.SubmitMany(self._requests())
        self.num_tokens = 0
        self.num_messages = 0  # SubmitMany responses: the scheduler's writes to the frontend
        self.errors: list[str] = []
        self.reader = asyncio.create_task(self._read())

    async def _requests(self):
        while (message := await self.outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        async for response in self.call:
            self.num_messages += 1
            for news in response.news:
                if news.error_code:
                    self.errors.append(news.error_message)
                self.num_tokens += sum(len(d.token_ids) for d in news.response.deltas)

    async def close(self) -> None:
        self.call.cancel()  # the scheduler aborts what still runs on the call
        await asyncio.gather(self.reader, return_exceptions=True)


PROFILED = ("import cProfile, runpy, sys, time; sys.argv = sys.argv[1:]; p = cProfile.Profile(time.process_time); "
            "p.enable()\ntry: runpy.run_module('services.scheduler', run_name='__main__', alter_sys=True)\n"
            "finally: p.disable(); p.dump_stats({out!r})")


def start_scheduler(port: int, profile_to: Path | None, tree: Path = REPO) -> subprocess.Popen:
    """`python -m services.scheduler` of the checkout `tree` (its code, its working directory)."""
    # --profile: cProfile on the process's CPU clock (time.process_time), so waiting in epoll is not counted
    python = [sys.executable] + (["-c", PROFILED.format(out=str(profile_to)), "services.scheduler"] if profile_to
                                 else ["-m", "services.scheduler"])
    command = python + ["--host", "127.0.0.1", "--port", str(port),
                        "--heartbeat-timeout-s", "60", "--max-model-len", str(INFO.max_model_len), "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(tree)})
    deadline = time.monotonic() + 60
    while not is_serving(f"127.0.0.1:{port}", timeout=1):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not start (exit {process.poll()})")
        time.sleep(0.1)
    return process


async def wait_for(stub, predicate, timeout: float, what: str) -> scheduler_pb2.GetStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        if predicate(stats):
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}: {stats}")
        await asyncio.sleep(0.05)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def measure(num_workers: int, seqs_per_worker: int, seconds: float, profile_to: Path | None = None,
                  tree: Path = REPO, step_s: float = 0.0) -> dict:
    [port] = free_ports(1)
    process = start_scheduler(port, profile_to, tree)
    scheduler, me = psutil.Process(process.pid), psutil.Process()
    address = f"127.0.0.1:{port}"
    workers = [StandInWorker(f"w{i:02d}", address, step_s) for i in range(num_workers)]
    channel = grpc.aio.insecure_channel(address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    load = None
    try:
        for worker in workers:
            await worker.start()
        await wait_for(stub, lambda s: len(s.workers) == num_workers, 30, "the workers to register")
        num_requests = num_workers * seqs_per_worker
        load = Load(stub, num_requests)
        await wait_for(stub, lambda s: s.num_running == num_requests, 60, "every request to run")
        await asyncio.sleep(0.5)  # past the prefills: decode steps only

        for worker in workers:
            worker.gaps.clear()
        each0, tokens0, messages0 = [w.num_steps for w in workers], load.num_tokens, load.num_messages
        cpu0, mine0, t0 = cpu_seconds(scheduler), cpu_seconds(me), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu1, mine1, t1 = cpu_seconds(scheduler), cpu_seconds(me), time.perf_counter()
        stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
        each = [w.num_steps - n for w, n in zip(workers, each0)]
        worker_steps, steps = sum(each), min(each)  # steps: the slowest worker's (each steps at its own pace)
        num_tokens, num_messages = load.num_tokens - tokens0, load.num_messages - messages0
        if load.errors or stats.num_running != num_requests:
            raise RuntimeError(f"the load changed during the window: {stats.num_running} running, {load.errors[:3]}")
        gaps = sorted(g for w in workers for g in w.gaps)
        wall = t1 - t0
        return {
            "workers": num_workers, "seqs_per_worker": seqs_per_worker, "seconds": wall,
            "steps_per_s": steps / wall,
            "worker_steps_per_s": worker_steps / wall,
            "tokens_per_s": num_tokens / wall,
            "scheduler_cpu_ms_per_worker_step": 1e3 * (cpu1 - cpu0) / max(worker_steps, 1),
            "scheduler_cpu_ms_per_step": 1e3 * (cpu1 - cpu0) / max(steps, 1),
            "scheduler_cpu_use": (cpu1 - cpu0) / wall,
            "messages_per_worker_step": num_messages / max(worker_steps, 1),
            "driver_cpu_use": (mine1 - mine0) / wall,
            "added_latency_ms_p50": 1e3 * statistics.median(gaps),
            "added_latency_ms_p99": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        }
    finally:
        if load is not None:
            await load.close()
        await channel.close()
        process.terminate()  # graceful: the requests were cancelled with the call, so it exits at once
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for worker in workers:
            await worker.stop()


def plot(rows: list[dict], path: Path, target_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = [r["workers"] for r in rows]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 4))
    left.plot(n, [r["steps_per_s"] for r in rows], "o-", label="steps/s (slowest worker's)")
    left.plot(n, [r["worker_steps_per_s"] for r in rows], "s-", label="worker-steps/s")
    left.set_xscale("log", base=2)
    left.set_xlabel("stand-in workers")
    left.set_title("throughput")
    left.legend()
    middle.plot(n, [r["scheduler_cpu_ms_per_worker_step"] for r in rows], "o-", label="scheduler CPU / worker-step")
    middle.axhline(target_ms, color="grey", linestyle="--", label=f"target {target_ms:g} ms")
    middle.set_xscale("log", base=2)
    middle.set_ylim(bottom=0)
    middle.set_xlabel("stand-in workers")
    middle.set_ylabel("ms")
    middle.set_title("scheduler CPU per worker-step")
    middle.legend()
    right.plot(n, [r["added_latency_ms_p50"] for r in rows], "o-", label="p50")
    right.plot(n, [r["added_latency_ms_p99"] for r in rows], "s-", label="p99")
    right.plot(n, [100 * r["scheduler_cpu_use"] for r in rows], "^:", label="scheduler CPU use, % of a core")
    right.set_xscale("log", base=2)
    right.set_xlabel("stand-in workers")
    right.set_title("latency added per step (ms)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32", help="stand-in worker counts, in order")
    parser.add_argument("--seqs-per-worker", type=int, default=8, help="running sequences per worker")
    parser.add_argument("--seconds", type=float, default=4.0, help="the measured window per worker count")
    parser.add_argument("--rounds", type=int, default=2,
                        help="sweeps, alternately up and down the worker counts; each figure is their median")
    parser.add_argument("--target-ms", type=float, default=1.0, help="scheduler CPU per worker-step, at 8 workers")
    parser.add_argument("--profile", type=int, default=0, help="only profile the scheduler at this many workers")
    parser.add_argument("--out", default="scheduler_scale", help="results file stem in bench/results")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="each stand-in's step time (a sleep); 0: it answers at once")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="another checkout whose scheduler runs interleaved with this one's (A/B); "
                             "repeat for more")
    return parser.parse_args()


def profile(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "scheduler.prof"
        row = uvloop.run(measure(args.profile, args.seqs_per_worker, args.seconds, profile_to=path,
                                 step_s=args.step_ms / 1e3))
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)


def tree_commit(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=tree, timeout=5).stdout.strip() or "n/a"


def show(label: str, row: dict) -> None:
    print(label, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def contenders(args: argparse.Namespace) -> dict[str, Path]:
    """This checkout and each --compare checkout, by name (its folder's, "this" for this one)."""
    trees = {"this": REPO}
    for tree in args.compare:
        name = tree.resolve().name
        while name in trees:
            name += "'"
        trees[name] = tree.resolve()
    return trees


def compare(args: argparse.Namespace) -> None:
    """This checkout's scheduler against each --compare checkout's, interleaved: per round and worker
    count all back to back, the order rotated (and reversed every other turn) so that no contender
    always runs first or last."""
    load_before = loadavg()
    trees = contenders(args)
    names, others = list(trees), list(trees)[1:]
    counts = [int(n) for n in args.workers.split(",")]
    runs: dict[int, dict[str, list[dict]]] = {n: {name: [] for name in names} for n in counts}
    turn = 0
    for round_index in range(args.rounds):
        for num_workers in counts if round_index % 2 == 0 else counts[::-1]:
            order = names[turn % len(names):] + names[:turn % len(names)]
            order = order[::-1] if (turn // len(names)) % 2 else order
            turn += 1
            for name in order:
                row = uvloop.run(measure(num_workers, args.seqs_per_worker, args.seconds, tree=trees[name],
                                         step_s=args.step_ms / 1e3))
                row["tree"] = name
                show(name, row)
                runs[num_workers][name].append(row)
    keys = ["scheduler_cpu_ms_per_worker_step", "worker_steps_per_s", "scheduler_cpu_use", "driver_cpu_use",
            "messages_per_worker_step", "added_latency_ms_p50", "added_latency_ms_p99"]
    table_rows, rows = [], []
    for n in counts:
        pair = runs[n]
        summary = {"workers": n, "ratios": {}}
        for other in others:
            ratios = [a["scheduler_cpu_ms_per_worker_step"] / b["scheduler_cpu_ms_per_worker_step"]
                      for a, b in zip(pair["this"], pair[other])]
            summary["ratios"][other] = {"median": statistics.median(ratios), "min": min(ratios),
                                        "max": max(ratios), "each": ratios}
        for name in names:
            cpu = [r["scheduler_cpu_ms_per_worker_step"] for r in pair[name]]
            summary[name] = {key: statistics.median(r[key] for r in pair[name]) for key in keys}
            summary[name]["cpu_min"], summary[name]["cpu_max"] = min(cpu), max(cpu)
            m = summary[name]
            ratio = summary["ratios"].get(name)
            table_rows.append([n, f"{name} ({tree_commit(trees[name])})", m["scheduler_cpu_ms_per_worker_step"],
                               f"{m['cpu_min']:.3g}-{m['cpu_max']:.3g}", m["worker_steps_per_s"],
                               m["scheduler_cpu_use"], m["driver_cpu_use"], m["messages_per_worker_step"],
                               m["added_latency_ms_p50"], m["added_latency_ms_p99"],
                               f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})" if ratio else ""])
        rows.append(summary)
    table = markdown_table(
        ["workers", "scheduler", "CPU ms / worker-step (median)", "range", "worker-steps/s", "scheduler CPU use",
         "driver CPU use", "messages / worker-step", "added ms p50", "added ms p99",
         "this / it, paired (median, range)"],
        table_rows)
    against = ", ".join(f"{name}'s (commit {tree_commit(trees[name])})" for name in others)
    body = (f"A/B: this checkout's scheduler against {against}, interleaved: for each of {args.rounds} rounds "
            f"and each worker count all ran back to back, the order rotated each turn, a fresh scheduler "
            f"process each, a {args.seconds:g} s window each; the same stand-in workers and client (this "
            f"checkout's), {args.seqs_per_worker} running sequences per worker, each "
            + (f"step taking {args.step_ms:g} ms (a sleep)" if args.step_ms else "step answered at once")
            + ". The last column is the median (and range) over rounds of the paired ratio of CPU ms per "
            "worker-step, this checkout's over that row's. \"messages\" are the SubmitMany responses the "
            "scheduler wrote to the client. The host is shared with other developers' jobs (load average "
            f"above).\n\n{table}")
    write_results(args.out, "One scheduler driving N stand-in workers: A/B against other checkouts", load_before,
                  body, {"seqs_per_worker": args.seqs_per_worker, "window_s": args.seconds, "step_ms": args.step_ms,
                         "commits": {name: tree_commit(tree) for name, tree in trees.items()}, "rows": rows,
                         "runs": [run for n in counts for name in names for run in runs[n][name]]})
    print(f"wrote {RESULTS_DIR / args.out}.md")


def main() -> None:
    args = parse_args()
    configure_logging("bench", "warning")
    if args.profile:
        return profile(args)
    if args.compare:
        return compare(args)
    load_before = loadavg()
    counts = [int(n) for n in args.workers.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for round_index in range(args.rounds):  # up, down, up...: a load change on the host hits every count
        for num_workers in counts if round_index % 2 == 0 else counts[::-1]:
            row = uvloop.run(measure(num_workers, args.seqs_per_worker, args.seconds, step_s=args.step_ms / 1e3))
            show("", row)
            runs[num_workers].append(row)
    rows = [{key: statistics.median(r[key] for r in runs[n]) if isinstance(value, float) else value
             for key, value in runs[n][0].items()} for n in counts]
    table = markdown_table(
        ["workers", "steps/s", "worker-steps/s", "tokens/s", "scheduler CPU ms / worker-step",
         "scheduler CPU ms / step", "scheduler CPU use", "driver CPU use", "added ms p50", "added ms p99"],
        [[r["workers"], r["steps_per_s"], r["worker_steps_per_s"], r["tokens_per_s"],
          r["scheduler_cpu_ms_per_worker_step"], r["scheduler_cpu_ms_per_step"], r["scheduler_cpu_use"],
          r["driver_cpu_use"], r["added_latency_ms_p50"], r["added_latency_ms_p99"]] for r in rows])
    body = (f"Stand-in workers (no model: each Step answered at once) registered with the real scheduler "
            f"service; {args.seqs_per_worker} running sequences per worker (decode, one token each per step); "
            f"a {args.seconds:g} s window per worker count, a fresh scheduler process each; {args.rounds} sweeps "
            f"alternately up and down the counts, each figure the median of its runs. The host is shared "
            f"with other developers' jobs (load average above).\n\n{table}\n![scheduler scale]({args.out}.png)\n")
    write_results(args.out, "One scheduler driving N stand-in workers", load_before, body,
                  {"seqs_per_worker": args.seqs_per_worker, "window_s": args.seconds, "step_ms": args.step_ms, "rows": rows,
                   "runs": [run for n in counts for run in runs[n]]})
    plot(rows, figure_path(args.out), args.target_ms)
    print(f"wrote {RESULTS_DIR / args.out}.md")


if __name__ == "__main__":
    main()
