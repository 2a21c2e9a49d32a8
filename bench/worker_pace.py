"""One worker slowed by a CPU hog: do the other worker's streams keep their pace?

    python bench/worker_pace.py                                   # the default model, 3 rounds of 2 x 6 s
    python bench/worker_pace.py --model tiny --rounds 2 --window 3     # a random tiny model: a quick check
    python bench/worker_pace.py --others-core 1        # 2 cores: worker-0 alone on core 0, the rest on core 1

The claim (issue 40): with one worker slowed to half speed by a CPU hog, the other worker's streams
keep at least 0.9x of their undisturbed rate. `python -m services up --workers 2 --num-threads 1`
runs the services; this script pins each worker (every thread of it) to a core of its own, worker-0
to the first of --cores, worker-1 to the second, and, when the machine has more cores, the scheduler,
the frontend and itself to the rest (on 2 cores they float: when the hog takes worker-1's core they
move onto worker-0's, so the claim's figure needs a third core). --others-core C pins the scheduler,
the frontend, the launcher and this client to core C instead: with C worker-1's core, on 2 cores
worker-0 has core 0 to itself and the hog shares core 1 with worker-1 and those services, so what
slows worker-0 then is only what it waits for from them (the scheduler's turn between its steps,
the frontend's streaming), not its own core.
It streams 2 x --streams-per-worker long greedy requests at once (placed by load: as many on each
worker) and keeps them running through every window (each started again with its prompt when it ends
at the model's length; its cached prefix keeps it on its worker). Rounds alternate two conditions, in an order
that flips each round: "undisturbed", and "hog" (a `while True: pass` process pinned to worker-1's
core, so the kernel shares that core between worker-1 and the hog: about half speed). A window is
--window seconds after --settle seconds for the condition to take hold.

Each window's figures come from the scheduler's GetStats: a worker's steps in the window (each
step gives one token to each of its decoding sequences), times the sequences running on it, over
the window: its streams' tokens/s. The client's own count of tokens over all streams in the window
is reported beside (it should equal the two workers' sum). Reported: the median over rounds of
each worker's tokens/s per condition, and the ratios hog/undisturbed (worker-0's is the claim:
>= 0.9; worker-1's shows the hog bit: about 0.5 on a quiet host). Writes bench/results/worker_pace.{md,json}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import REPO, loadavg, markdown_table, write_results  # noqa: E402
from workload import model_folder  # noqa: E402

BUSY_LOOP = "while True: pass"
CLAIM = 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default",
                        help="a model folder or hub id, default (SmolLM2-135M-Instruct), or tiny or small (a random "
                             "model, built once in the temp folder)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams-per-worker", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=6.0, help="seconds measured per condition and round")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after a condition starts, unmeasured")
    parser.add_argument("--cores", default="0,1", help="the two cores worker-0 and worker-1 are pinned to")
    parser.add_argument("--others-core", type=int, default=None,
                        help="pin the scheduler, the frontend, the launcher and this client to this core (e.g. "
                             "worker-1's on a 2-core machine); default: the cores other than --cores, unpinned when "
                             "there are none")
    parser.add_argument("--out", default="worker_pace", help="results file stem in bench/results")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    return parser.parse_args()


def resolve_model(model: str) -> Path:
    if model not in ("tiny", "small"):
        return model_folder(model)
    from services.tools.make_model import make_model
    out = Path(tempfile.gettempdir()) / f"pagedserve-worker-pace-{model}"
    if not (out / "config.json").is_file():
        make_model(out, arch="llama", size=model, seed=0, dtype="float32")
    return out


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` onto `cores` (threads it starts later inherit it); checked."""
    for thread in psutil.Process(pid).threads():
        try:
            os.sched_setaffinity(thread.id, cores)
            if set(os.sched_getaffinity(thread.id)) != cores:
                raise SystemExit(f"thread {thread.id} of {pid} did not take the affinity {sorted(cores)}")
        except ProcessLookupError:
            pass


class Services:
    """`python -m services up --workers 2 --num-threads 1` on free loopback ports."""

    def __init__(self, model: str, dtype: str, timeout: float):
        from services.launch.deployment import free_ports
        from services.launch.healthcheck import is_serving

        grpc_port, http_port, self.scheduler_port = free_ports(3)
        self.address = f"127.0.0.1:{grpc_port}"
        self.log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-worker-pace-"))
        command = [sys.executable, "-m", "services", "up", "--model", model, "--workers", "2", "--num-threads", "1",
                   "--dtype", dtype, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                   "--scheduler-port", str(self.scheduler_port), "--log-level", "warning",
                   "--log-dir", str(self.log_dir)]
        with open(self.log_dir / "launcher.log", "w") as launcher_log:
            self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=launcher_log,
                                            start_new_session=True,
                                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + timeout
        while not (is_serving(self.address, timeout=1.0) and len(self.stats().workers) == 2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"services did not start (exit {self.process.poll()}); logs in {self.log_dir}")
            time.sleep(0.5)

    def stats(self):
        import grpc
        from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}") as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def pids(self) -> dict[str, int]:
        """Each service's name ("scheduler", "worker-0", ...) -> its pid, from the launcher's log."""
        found = {}
        for line in (self.log_dir / "launcher.log").read_text().splitlines():
            if line.startswith("{") and (event := json.loads(line)).get("event") == "service_started":
                found[event["service_name"]] = event["pid"]
        return found

    def worker_names(self) -> dict[str, str]:
        """A worker's address (as GetStats gives it) -> its name in `up` (worker-0, worker-1)."""
        names = {}
        for name, pid in self.pids().items():
            argv = psutil.Process(pid).cmdline()
            if name.startswith("worker-"):
                names[f"127.0.0.1:{argv[argv.index('--port') + 1]}"] = name
        return names

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


class Hog:
    """A busy loop pinned to one core, while in the `with`."""

    def __init__(self, core: int):
        self.core = core

    def __enter__(self) -> Hog:
        self.process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        pin(self.process.pid, {self.core})
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()


async def stream_forever(address: str, prompts: list[list[int]], max_tokens: int, counts: list[int]) -> None:
    """Greedy streams, each adding its tokens to counts[i] as they arrive, each started again with its
    prompt when it ends (its prefix cached where it ran, so it stays on its worker); until cancelled."""
    from pagedserve import AsyncClient

    async with AsyncClient(address) as client:
        async def one(i: int) -> None:
            while True:
                async for delta in client.generate(prompts[i], temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True):
                    counts[i] += len(delta.token_ids)
        await asyncio.gather(*(one(i) for i in range(len(prompts))))


def worker_figures(before, after, seconds: float) -> dict[str, dict]:
    """Each worker's steps/s and its streams' tokens/s over a window, from two GetStats."""
    start = {w.address: w.num_steps for w in before.workers}
    figures = {}
    for w in after.workers:
        steps_per_s = (w.num_steps - start[w.address]) / seconds
        figures[w.address] = {"steps_per_s": steps_per_s, "num_running": w.num_running,
                              "tokens_per_s": steps_per_s * w.num_running}
    return figures


async def measure(services: Services, args, names: dict[str, str], hog_core: int) -> list[dict]:
    stats = await asyncio.to_thread(services.stats)
    vocab, max_len = stats.vocab_size, stats.max_model_len
    rng = random.Random(40)
    num_streams = 2 * args.streams_per_worker
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(num_streams)]
    counts = [0] * num_streams
    streams = asyncio.create_task(stream_forever(services.address, prompts, max_len - args.prompt_len - 1, counts))
    windows = []
    try:
        while sum(c > 0 for c in counts) < num_streams:  # every stream decoding
            if streams.done():
                streams.result()
            await asyncio.sleep(0.1)
        for round_index in range(args.rounds):
            order = ("undisturbed", "hog") if round_index % 2 == 0 else ("hog", "undisturbed")
            for condition in order:
                hog = Hog(hog_core) if condition == "hog" else None
                if hog:
                    hog.__enter__()
                try:
                    await asyncio.sleep(args.settle)
                    before, tokens_before, start = await asyncio.to_thread(services.stats), sum(counts), time.monotonic()
                    await asyncio.sleep(args.window)
                    after, tokens_after = await asyncio.to_thread(services.stats), sum(counts)
                    seconds = time.monotonic() - start
                finally:
                    if hog:
                        hog.__exit__()
                if streams.done():
                    raise SystemExit(f"the streams failed: {streams.exception()!r}")
                figures = worker_figures(before, after, seconds)
                window = {"round": round_index, "condition": condition, "seconds": seconds,
                          "client_tokens_per_s": (tokens_after - tokens_before) / seconds,
                          **{names[a]: f for a, f in figures.items()}}
                windows.append(window)
                print(f"round {round_index} {condition:11s} worker-0 {window['worker-0']['tokens_per_s']:7.1f} "
                      f"tok/s  worker-1 {window['worker-1']['tokens_per_s']:7.1f} tok/s  "
                      f"client {window['client_tokens_per_s']:7.1f}",
                      flush=True)
    finally:
        streams.cancel()
        try:
            await streams
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the streams are being torn down
            pass
    return windows


def summarize(windows: list[dict]) -> dict:
    summary = {}
    for worker in ("worker-0", "worker-1"):
        by = {c: [w[worker]["tokens_per_s"] for w in windows if w["condition"] == c] for c in ("undisturbed", "hog")}
        medians = {c: statistics.median(v) for c, v in by.items()}
        summary[worker] = {**{f"{c}_tokens_per_s": m for c, m in medians.items()},
                           "ratio": medians["hog"] / medians["undisturbed"] if medians["undisturbed"] else 0.0,
                           "range": {c: [min(v), max(v)] for c, v in by.items()}}
    return summary


def main() -> None:
    args = parse_args()
    cores = [int(c) for c in args.cores.split(",")]
    rest = {args.others_core} if args.others_core is not None else set(os.sched_getaffinity(0)) - set(cores)
    load_before = loadavg()
    folder = resolve_model(args.model)
    services = Services(str(folder), args.dtype, args.startup_timeout)
    try:
        pids = services.pids()
        names = services.worker_names()
        for name, core in zip(("worker-0", "worker-1"), cores):
            pin(pids[name], {core})
        if rest:  # the scheduler, the frontend and this client off the workers' cores (or onto --others-core)
            for service in ("scheduler", "frontend"):
                pin(pids[service], rest)
            pin(services.process.pid, rest)  # the launcher (`up`): it only watches, but not on worker-0's core
            pin(os.getpid(), rest)
        windows = asyncio.run(measure(services, args, names, hog_core=cores[1]))
    finally:
        services.stop()
    summary = summarize(windows)
    rows = [[f"{w} ({'the hog on its core' if w == 'worker-1' else 'the claim'})", s["undisturbed_tokens_per_s"],
             s["hog_tokens_per_s"], s["ratio"]] for w, s in summary.items()]
    verdict = "holds" if summary["worker-0"]["ratio"] >= CLAIM else "does not hold"
    body = (f"Model {args.model}, {args.dtype}; `up --workers 2 --num-threads 1`; worker-0 pinned to core {cores[0]}, "
            f"worker-1 to core {cores[1]}, the hog to core {cores[1]}; "
            + (f"scheduler, frontend, launcher and client pinned to core{'s' if len(rest) > 1 else ''} "
               f"{', '.join(map(str, sorted(rest)))}" + (" (worker-1's: there the hog slows worker-1 and them, "
                                                       f"and worker-0 has core {cores[0]} to itself)"
                                                       if rest == {cores[1]} else "") if rest else
               "scheduler, frontend and client unpinned: with no third core, when the hog takes worker-1's core they "
               "can only run on worker-0's, so this run measures that too, not only the workers' independence; the "
               "claim's figure needs a machine with a third core, where they are pinned off the workers' cores")
            + f". {2 * args.streams_per_worker} greedy streams ({args.prompt_len}-token prompts), {args.rounds} rounds "
            f"of {args.window:g} s per condition after {args.settle:g} s to settle, the order flipped each round; "
            "medians over rounds.\n\n"
            + markdown_table(["worker", "undisturbed tok/s", "hog tok/s", "hog / undisturbed"], rows)
            + f"\nThe claim (worker-0 keeps >= {CLAIM}x): {verdict} in this run.\n\n"
            + markdown_table(["round", "condition", "worker-0 tok/s", "worker-1 tok/s", "client tok/s (both)"],
                             [[w["round"], w["condition"], w["worker-0"]["tokens_per_s"], w["worker-1"]["tokens_per_s"],
                               w["client_tokens_per_s"]] for w in windows]))
    if float(load_before.split()[0]) > 1.0:
        body += (f"\nThe host was shared when this ran (1-minute load {load_before.split()[0]} before, on "
                 f"{os.cpu_count()} CPUs): the figures check that the script works, they do not test the claim; "
                 "rerun it on a quiet machine.\n")
    md = write_results(args.out, "A CPU hog on one worker's core: the other worker's pace", load_before, body,
                       {"args": vars(args), "cores": cores, "other_cores": sorted(rest), "summary": summary,
                        "windows": windows})
    print(md.read_text())


if __name__ == "__main__":
    main()
