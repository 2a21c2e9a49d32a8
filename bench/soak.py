"""A bounded soak of `python -m services up`: mixed traffic with faults, then a verdict.

    python bench/soak.py --duration 60 --workers 2 --concurrency 12 [--model tiny|small|PATH] [--record]

1. Starts the deployment (a tiny random-weight model by default) and sends every request spec
   once, fault-free, over gRPC: the reference tokens and text.
2. For --duration seconds, --concurrency clients send specs drawn at random over gRPC (Generate
   streamed, GenerateBatch) and HTTP (/v1/completions with SSE or one JSON body); --disconnect of
   them go away mid-answer (or before it), --deadline of them carry a deadline. At --kill-at of
   the run, worker-0 gets SIGKILL, and at --scheduler-kill-at the scheduler does; the launcher
   restarts each (the frontend carries its open requests over to the new scheduler).
3. Pass: no failure among the requests that were neither cancelled nor timed out (an error, or
   tokens/text other than the reference's; a deadline that reached a gRPC client as INTERNAL after
   it passed is counted apart, as timed_out_as_internal: gRPC's own best effort, grpc/grpc#2685),
   the killed worker and scheduler are back (new pids, the scheduler
   counts --workers again), and every KV block is free again. Reported too: each service's
   resident memory before and after the run.

--json PATH writes the summary; --record writes bench/results/soak.{md,json}. Exit status 0 on pass.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import REPO, loadavg, markdown_table, write_results
from soak_traffic import GrpcShots, HttpShots, Outcome, Shot, Spec, draw_shot, make_specs

sys.path.insert(0, str(REPO))


class Deployment:
    """`python -m services up` as a subprocess; the launcher's JSON events read from its stderr."""

    def __init__(self, model: str, workers: int, extra: list[str]):
        from services.launch.deployment import free_ports
        self.grpc_port, self.http_port, self.scheduler_port = free_ports(3)
        self.log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-soak-"))
        command = [sys.executable, "-m", "services", "up", "--model", model, "--workers", str(workers),
                   "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
                   "--scheduler-port", str(self.scheduler_port), "--log-dir", str(self.log_dir), *extra]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.events: list[dict] = []
        threading.Thread(target=self._read_events, daemon=True).start()

    def _read_events(self) -> None:
        for line in self.proc.stderr:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def pids(self) -> dict[str, int]:
        return {e["service_name"]: e["pid"] for e in list(self.events) if e["event"] == "service_started"}

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not (found := predicate()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"soak: not {what} (launcher exit {self.proc.poll()}); logs in {self.log_dir}")
            time.sleep(0.2)
        return found

    def stats(self):
        import grpc

        from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}") as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


def resident_mb(pids: dict[str, int]) -> dict[str, float]:
    import psutil
    sizes = {}
    for name, pid in pids.items():
        try:
            sizes[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            sizes[name] = float("nan")
    return sizes


def idle(stats) -> bool:
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_swapped == 0 and \
        all(w.num_free_gpu_blocks == w.num_gpu_blocks for w in stats.workers)


def check(outcome: Outcome, reference: Outcome, transport: str) -> str:
    """Why a finished answer differs from the fault-free one ("" when it does not)."""
    if outcome.text != reference.text:
        return f"text {outcome.text!r} != {reference.text!r}"
    if transport.startswith("grpc") and outcome.token_ids != reference.token_ids:
        return f"token ids {outcome.token_ids} != {reference.token_ids}"
    if transport.startswith("http") and outcome.num_tokens != reference.num_tokens:
        return f"{outcome.num_tokens} tokens != {reference.num_tokens}"
    return ""


async def reference_pass(address: str, specs: list[Spec]) -> list[Outcome]:
    client = GrpcShots(address)
    try:
        found = await asyncio.gather(*(client.send(spec, Shot(i, "grpc-stream")) for i, spec in enumerate(specs)))
    finally:
        await client.close()
    bad = [o for o in found if o.kind != "completed"]
    if bad:
        raise SystemExit(f"soak: the fault-free pass failed: {bad[0].error}")
    return list(found)


async def soak(args, deployment: Deployment, specs: list[Spec], reference: list[Outcome]) -> dict:
    clients = {"grpc": GrpcShots(f"127.0.0.1:{deployment.grpc_port}"),
               "http": HttpShots(f"127.0.0.1:{deployment.http_port}")}
    tally: Counter = Counter()
    failures: list[dict] = []
    end = time.monotonic() + args.duration

    async def client(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        while time.monotonic() < end:
            shot = draw_shot(rng, len(specs), args.disconnect, args.deadline)
            outcome = await clients[shot.transport.split("-")[0]].send(specs[shot.spec_index], shot)
            why = outcome.error if outcome.kind == "error" else \
                check(outcome, reference[shot.spec_index], shot.transport) if outcome.kind == "completed" else ""
            tally[(shot.fate, shot.transport, outcome.kind if not why else "failed")] += 1
            if why:
                failures.append({"shot": shot.__dict__, "outcome": outcome.kind, "why": why[:500]})

    killers = [asyncio.create_task(kill(deployment, "worker-0", args.duration * args.kill_at))]
    if args.scheduler_kill_at:
        killers.append(asyncio.create_task(kill(deployment, "scheduler", args.duration * args.scheduler_kill_at)))
    await asyncio.gather(*(client(i) for i in range(args.concurrency)))
    killed = await asyncio.gather(*killers)
    for c in clients.values():
        await c.close()
    return {"tally": tally, "failures": failures, "kill": killed[0], "scheduler_kill": killed[1:]}


async def kill(deployment: Deployment, service: str, after_s: float) -> dict:
    """SIGKILL `service` after `after_s`; its pid, the launcher's new one and how long it took."""
    await asyncio.sleep(after_s)
    victim = deployment.pids()[service]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    while True:
        ready = [e for e in list(deployment.events) if e["event"] == "service_ready"
                 and e["service_name"] == service and e["pid"] != victim]
        if ready or time.monotonic() - killed_at > 120:
            new_pid = ready[0]["pid"] if ready else None
            return {"pid": victim, "new_pid": new_pid,
                    "back_after_s": round(time.monotonic() - killed_at, 1) if ready else None,
                    "new_pid_resident_mb": resident_mb({service: new_pid})[service] if ready else None}
        await asyncio.sleep(0.2)


def settle(args, deployment: Deployment) -> dict:
    """After the traffic: are the workers all back, and is every block free again?"""
    deadline = time.monotonic() + 60
    while True:
        stats = deployment.stats()
        if (len(stats.workers) == args.workers and idle(stats)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {"num_workers": len(stats.workers), "idle": idle(stats), "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "blocks": {w.worker_id: [w.num_free_gpu_blocks, w.num_gpu_blocks] for w in stats.workers}}


def run(args) -> dict:
    model = resolve_model(args.model)
    extra = ["--dtype", "float32", "--num-gpu-blocks", str(args.num_gpu_blocks), "--log-level", "warning",
             "--startup-timeout", "300"]
    deployment = Deployment(str(model), args.workers, extra)
    try:
        deployment.wait(lambda: _serving(deployment) and len(deployment.stats().workers) == args.workers, 360,
                        "serving with every worker")
        specs = make_specs(args.num_specs, args.vocab_size, args.seed)
        reference = asyncio.run(reference_pass(f"127.0.0.1:{deployment.grpc_port}", specs))
        idle_before = settle(args, deployment)
        memory_before = resident_mb(deployment.pids())
        started = time.monotonic()
        result = asyncio.run(soak(args, deployment, specs, reference))
        elapsed = time.monotonic() - started
        idle_after = settle(args, deployment)
        memory_after = resident_mb(deployment.pids())
    finally:
        exit_code = deployment.stop()
    return summarize(args, result, elapsed, idle_before, idle_after, memory_before, memory_after, exit_code)


def _serving(deployment: Deployment) -> bool:
    from services.launch.healthcheck import is_serving
    return is_serving(f"127.0.0.1:{deployment.grpc_port}", timeout=1.0)


def resolve_model(model: str) -> Path:
    if model not in ("tiny", "small"):
        return Path(model)
    from services.tools.make_model import make_model
    out = Path(tempfile.gettempdir()) / f"pagedserve-soak-{model}"
    if not (out / "config.json").is_file():
        make_model(out, arch="llama", size=model, seed=0, dtype="float32")
    return out


def summarize(args, result, elapsed, idle_before, idle_after, memory_before, memory_after, exit_code) -> dict:
    tally = result["tally"]
    by_kind = Counter()
    for (fate, _, kind), n in tally.items():
        by_kind[(fate, kind)] += n
    kill, scheduler_kill = result["kill"], (result["scheduler_kill"] or [None])[0]
    memory_before = {**memory_before, "worker-0": kill["new_pid_resident_mb"] or float("nan")}  # the new one
    if scheduler_kill is not None:
        memory_before["scheduler"] = scheduler_kill["new_pid_resident_mb"] or float("nan")
    growth = {name: round(memory_after.get(name, float("nan")) - mb, 1) for name, mb in memory_before.items()}
    passed = not result["failures"] and kill["new_pid"] is not None and idle_after["idle"] \
        and (scheduler_kill is None or scheduler_kill["new_pid"] is not None) \
        and idle_after["num_workers"] == args.workers and exit_code == 0
    return {"passed": passed, "duration_s": round(elapsed, 1), "requests": sum(tally.values()),
            "by_fate_and_outcome": {f"{fate}/{kind}": n for (fate, kind), n in sorted(by_kind.items())},
            "by_shot": {"/".join(key): n for key, n in sorted(tally.items())},
            "failures": result["failures"][:20], "num_failures": len(result["failures"]), "worker_kill": kill,
            "scheduler_kill": scheduler_kill,
            "after_the_run": idle_after, "before_the_run": idle_before, "resident_mb_before": memory_before,
            "resident_mb_after": memory_after, "resident_mb_growth": growth, "launcher_exit": exit_code,
            "note": "the 'before' of worker-0 and of the scheduler is the restarted process's, when it was back; "
                    "the others' at the start"}


def report(summary: dict) -> str:
    rows = [[key, n] for key, n in summary["by_fate_and_outcome"].items()]
    memory = [[name, summary["resident_mb_before"][name], summary["resident_mb_after"].get(name),
               summary["resident_mb_growth"][name]] for name in summary["resident_mb_before"]]
    kill, scheduler_kill = summary["worker_kill"], summary["scheduler_kill"]
    scheduler = "" if scheduler_kill is None else \
        f"the scheduler (pid {scheduler_kill['pid']}) killed, back as pid {scheduler_kill['new_pid']} after " \
        f"{scheduler_kill['back_after_s']} s; "
    return "\n".join([
        "", "## Verdict", "",
        f"**{'PASS' if summary['passed'] else 'FAIL'}**: {summary['requests']} requests in "
        f"{summary['duration_s']} s, {summary['num_failures']} failures among those neither cancelled nor "
        f"timed out; worker-0 (pid {kill['pid']}) killed, back as pid {kill['new_pid']} after "
        f"{kill['back_after_s']} s; {scheduler}after the run: {summary['after_the_run']['num_workers']} workers, every KV "
        f"block free: {summary['after_the_run']['idle']}; launcher exit {summary['launcher_exit']} on SIGTERM.", "",
        markdown_table(["fate/outcome", "requests"], rows),
        markdown_table(["service", "RSS before (MiB)", "after", "growth"], memory),
        summary["note"] + ".",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    parser.add_argument("--model", default="tiny", help="tiny or small (random weights, built once), or a folder")
    parser.add_argument("--vocab-size", type=int, default=512, help="prompt ids are drawn below this")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-gpu-blocks", type=int, default=256, help="KV blocks per worker")
    parser.add_argument("--concurrency", type=int, default=12, help="clients sending at once")
    parser.add_argument("--num-specs", type=int, default=48, help="distinct requests drawn from")
    parser.add_argument("--disconnect", type=float, default=0.15, help="share of requests whose client goes away")
    parser.add_argument("--deadline", type=float, default=0.15, help="share of requests with a deadline")
    parser.add_argument("--kill-at", type=float, default=0.4, help="kill worker-0 at this fraction of the run")
    parser.add_argument("--scheduler-kill-at", type=float, default=0.7,
                        help="kill the scheduler at this fraction of the run (0: not)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--record", action="store_true", help="write bench/results/soak.{md,json}")
    args = parser.parse_args()
    load_before = loadavg()
    summary = run(args)
    text = report(summary)
    print(text)
    if summary["failures"]:
        print(json.dumps(summary["failures"][:5], indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.record:
        write_results("soak", "Soak: mixed traffic, disconnects, deadlines, a killed worker, a killed scheduler",
                      load_before, text, summary)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
