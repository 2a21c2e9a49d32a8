"""Serving benchmark: streamed requests arriving over time at the running services.

    python bench/serving.py                                   # starts the services, rates 0.5,1,inf
    python bench/serving.py --address 127.0.0.1:50051 --rates 0.25,0.5,1,2,inf --num-requests 32
    python bench/serving.py --backend http --address 127.0.0.1:8000 --burstiness 0.5

Arrivals: a Poisson process at --rates requests/s (gamma inter-arrival times when
--burstiness is not 1, as vLLM's benchmark_serving: shape = burstiness, same mean; "inf"
sends all at once), seeded. Each request streams (greedy, ignore_eos, its workload output
length). Per rate: completed / failed, requests/s, output and total tokens/s, and mean,
median, p90, p99 of TTFT (first token), TPOT ((E2E - TTFT) / (tokens - 1)), ITL (gaps
between token-carrying stream messages) and E2E latency. --max-seconds bounds each rate:
requests still running then are cancelled and counted as failed. Loopback only.
Writes bench/results/serving.{md,json,png} (the latency-throughput curve).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from common import figure_path, loadavg, markdown_table, write_results  # noqa: E402
from workload import add_workload_flags, describe, load_workload, model_folder, summary  # noqa: E402

PERCENTILES = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


async def one(backend, request, records: list, bar) -> None:
    start = time.perf_counter()
    try:
        times, tokens = await backend.stream(request)
        records.append({"ok": True, "start": start, "times": times, "tokens": tokens,
                        "prompt": request.prompt_len, "end": time.perf_counter()})
    except Exception as exc:  # a refused or failed call is a result, not a crash
        records.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]})
    bar.update(1)


async def run_rate(backend, requests, rate: float, args) -> dict:
    records, tasks = [], []
    gaps = arrival_gaps(len(requests), rate, args.burstiness, args.seed)
    with tqdm(total=len(requests), desc=f"rate {rate}", unit="req") as bar:
        start = time.perf_counter()
        for request, gap in zip(requests, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(backend, request, records, bar)))
        remaining = max(args.max_seconds - (time.perf_counter() - start), 1.0)
        done, pending = await asyncio.wait(tasks, timeout=remaining)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    failed = len(requests) - sum(r["ok"] for r in records)
    return metrics([r for r in records if r["ok"]], failed, duration, rate,
                   [r["error"] for r in records if not r["ok"]][:3])


def _stats(values: list[float]) -> dict:
    if not values:
        return {name: None for name, _ in PERCENTILES}
    ordered = sorted(values)
    pick = lambda p: ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]  # noqa: E731
    return {name: (statistics.mean(values) if p is None else pick(p)) * 1e3 for name, p in PERCENTILES}


def metrics(ok: list[dict], failed: int, duration: float, rate: float, errors: list[str]) -> dict:
    output = sum(r["tokens"] for r in ok)
    ttft = [r["times"][0] - r["start"] for r in ok if r["times"]]
    e2e = [r["end"] - r["start"] for r in ok]
    tpot = [(r["end"] - r["times"][0]) / (r["tokens"] - 1) for r in ok if r["times"] and r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {"rate": rate, "completed": len(ok), "failed": failed, "duration_s": duration,
            "requests_per_s": len(ok) / duration, "output_tok_s": output / duration,
            "total_tok_s": (output + sum(r["prompt"] for r in ok)) / duration,
            "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e),
            "errors": errors}


def make_backend(args, address: str):
    from stream_clients import GrpcBackend, HttpBackend
    return GrpcBackend(address) if args.backend == "grpc" else HttpBackend(address)


async def sweep(args, requests, address: str) -> list[dict]:
    results = []
    for rate in args.rates:
        backend = make_backend(args, address)
        try:
            results.append(await run_rate(backend, requests, rate, args))
        finally:
            await backend.close()
        print(_row(results[-1]), flush=True)
    return results


def _row(r: dict) -> list:
    cell = lambda m, k: "n/a" if r[m][k] is None else round(r[m][k], 1)  # noqa: E731
    return [r["rate"], r["completed"], r["failed"], round(r["requests_per_s"], 3), r["output_tok_s"],
            r["total_tok_s"]] + [cell(m, k) for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                                 for k, _ in PERCENTILES]


def report(results: list[dict], args, requests, load_before: str) -> Path:
    headers = ["rate req/s", "done", "failed", "req/s", "out tok/s", "total tok/s"] + \
        [f"{m} {k}" for m in ("TTFT", "TPOT", "ITL", "E2E") for k, _ in PERCENTILES]
    table = markdown_table(headers, [_row(r) for r in results])
    body = (f"Backend: {args.backend}; workload: {describe(args)}; {summary(requests)}; burstiness "
            f"{args.burstiness}; latencies in ms.\n\n{table}\n![serving]({args.out}.png)\n")
    errors = [e for r in results for e in r["errors"]]
    if errors:
        body += "\nFirst errors: " + "; ".join(errors[:5]) + "\n"
    _plot(results, figure_path(args.out))
    return write_results(args.out, "Serving: latency against throughput", load_before, body,
                         {"workload": describe(args), "backend": args.backend, "results": results})


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = [r["output_tok_s"] for r in results]
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
        for key in ("median", "p99"):
            ax.plot(x, [r[metric][key] or 0 for r in results], "o-", label=key)
        for r, xi in zip(results, x):
            ax.annotate(f"{r['rate']}/s", (xi, r[metric]["median"] or 0), fontsize=7)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(metric.replace("_ms", " (ms)").upper())
        ax.legend()
    fig.suptitle("Latency against throughput (labels: request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.set_defaults(num_requests=16, max_output_len=64)
    parser.add_argument("--backend", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--address", default=None, help="running frontend (gRPC or HTTP port); none: start one")
    parser.add_argument("--rates", default="0.5,1,inf", help="requests/s, comma-separated; inf: all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="per rate; later requests are cancelled")
    parser.add_argument("--dtype", default="float32", help="when the services are started here")
    parser.add_argument("--out", default="serving")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


def main() -> None:
    args = parse_args()
    from services_run import launched, require_services
    require_services()
    load_before = loadavg()
    requests = load_workload(args)
    if args.address:
        context = contextlib.nullcontext(args.address)
    else:
        context = launched(str(model_folder(args.model)), args.dtype, backend=args.backend)
    with context as address:
        results = asyncio.run(sweep(args, requests, address))
    print(report(results, args, requests, load_before).read_text())


if __name__ == "__main__":
    main()
