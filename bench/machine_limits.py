"""This machine's limits and the bound each GGUF file's decode and prefill can reach on it: is a speed
target (issue 41: the engine >= 1.5x llama-bench's batch-1 decode, >= 3x its pp512) possible here at all?

    python bench/machine_limits.py                       # the probes alone, 1 and 2 threads
    python bench/machine_limits.py MODELS/llama-1b-Q4_K_M MODELS/llama-1b-Q4_0 --llama-cpp-dir DIR --rounds 1

Probes (bench/machine_probe.c, compiled here with -O3 -march=native; 1 and 2 threads, --probe-repeats
rounds, median and best): the int8 multiply-add peak (vpdpbusd zmm where the CPU has AVX-512 VNNI; the
AVX2 chain vpmaddubsw + vpmaddwd + vpaddd on ymm), the fp32 FMA peak (vfmadd231ps on zmm and ymm),
vpdpbusd with the fold an exact kernel of a 32-element block format does per block (vnni512fold: the
int32 sum converted, the scales' product, an fma; 3 operations per 8 vpdpbusd; weights in L1: a ceiling
for quant_dot.c's tiles, not a bound used below),
each a tight loop over independent accumulators (throughput-bound), the best of eight 25 ms runs;
the clock (a chain of dependent adds, one per cycle), so that each peak is also given per cycle,
which the load does not change; and the read bandwidth (the probe's 512 MiB sum and
bench/roofline.py's copy / sum / one-row GEMM probe, the higher of the two).

Bounds per file (gguf_costs; the arithmetic is bounds()):
  decode tok/s <= read bandwidth / bytes one token reads: every tensor of the file once, the
                  token embedding's one row only (unless the output layer is the embedding, tied), a
                  mixture-of-experts' expert tensors by expert_used_count / expert_count (batch 1 reads
                  the experts it routes to); the KV cache at short context (< 1%) left out
  pp{N} tok/s  <= int8 peak / (2 x multiply-adds per token): the linear layers (active experts only),
                  the output layer once per prompt, attention's QK^T and PV at the causal mean context
                  (N + 1) / 2; every multiply-add counted at the int8 peak, the fastest this CPU has
Both are upper bounds: no kernel streams faster than the probe reads, nor multiplies faster than its
loop. With files given, each runs bench/gguf_speed.py's actquant section (the engine with fp32 and
int8 activations, llama-bench tg and pp), a probe round interleaved with the contenders in each
round, so the bounds and the contenders meet the same load; the report gives each contender's
fraction of the bound and what the target (1.5x / 3x llama.cpp) needs of it. The probes also run
before and after, at 1 and 2 threads. Writes bench/results/<--out>.{md,json}.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

SOURCE = Path(__file__).with_name("machine_probe.c")
FLAGS = ["-O3", "-march=native", "-pthread"]
COMPUTE = {"vnni512": "int8 vpdpbusd zmm", "vnni512fold": "int8 vpdpbusd zmm + a 32-block's fold (Q8_0's tile)",
           "int8avx2": "int8 vpmaddubsw+vpmaddwd ymm",
           "fma512": "fp32 FMA zmm", "fma256": "fp32 FMA ymm"}  # probe -> what it runs
INT8 = ("vnni512", "int8avx2")
READ_MIB = 512


# ---- the probes -------------------------------------------------------------------------
def probe_binary() -> Path:
    """bench/machine_probe.c compiled for this CPU, once per source, compiler and CPU."""
    from kernels.build import built_once
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc) on PATH: the probes need one")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()
                         + cpu_flags().encode() + platform.machine().encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "pagedserve-machine-probe"
    folder.mkdir(exist_ok=True)
    target = folder / f"machine_probe-{key}"
    with built_once(target):
        if not target.exists():
            partial = folder / f"{target.name}.partial"
            subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE)], check=True)
            partial.replace(target)
    return target


def _run_probe(*args) -> list[tuple[float, float] | None]:
    """Each line's (rate over wall time, rate over the threads' own CPU time); None: unsupported."""
    out = subprocess.run([str(probe_binary()), *map(str, args)], capture_output=True, text=True, check=True).stdout
    return [None if line.split()[2] == "unsupported" else tuple(map(float, line.split()[2:4]))
            for line in out.splitlines()]


def compute_peak(kind: str, threads: int, ms: int = 25, tries: int = 8) -> tuple[float, float] | None:
    """Multiply-adds (or FMAs, or clock cycles) per second of the probe's loop on `threads` threads, over
    wall time and over the threads' CPU time, each the best of `tries` short runs (on a shared host a
    short run is likelier to find the cores free); None where this CPU or compiler lacks the instructions."""
    runs = [_run_probe(kind, threads, ms)[0] for _ in range(tries)]
    return None if runs[0] is None else (max(r[0] for r in runs), max(r[1] for r in runs))


def read_bandwidth(threads: int) -> tuple[float, float]:
    """Read bytes/s over wall time: the better of the probe's sum over READ_MIB (median of its five
    passes) and bench/roofline.py's probe on `threads` torch threads (one more implementation of a
    read the engine could use: the higher is the limit); and the probe's over its threads' CPU time."""
    import torch
    from roofline import bandwidth
    passes = _run_probe("read", threads, READ_MIB)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_probe = bandwidth(repeats=3)
    finally:
        torch.set_num_threads(saved)
    return max(statistics.median(p[0] for p in passes), torch_probe), statistics.median(p[1] for p in passes)


def probe_round(threads: int) -> dict:
    """One of each probe on `threads` threads: {probe: multiply-adds/s over wall time, "cpu:" + probe:
    the same over the threads' CPU time, ...}; "clock" is cycles/s summed over the threads, "read"
    bytes/s. The wall rates are what the contenders beside them could get under the load of the
    moment; the CPU-time rates are the quiet machine's (cores nobody else held)."""
    result = {}
    for kind in (*COMPUTE, "clock"):
        rates = compute_peak(kind, threads)
        result[kind], result[f"cpu:{kind}"] = rates if rates else (None, None)
    result["read"], result["cpu:read"] = read_bandwidth(threads)
    return result


def per_cycle(rounds: list[dict], kind: str) -> float | None:
    """The probe's multiply-adds per cycle per core: the median over rounds of its CPU-time rate over
    the clock probe's (cycles per CPU second), which no load changes."""
    ratios = [r[f"cpu:{kind}"] / r["cpu:clock"] for r in rounds if r.get(f"cpu:{kind}") and r.get("cpu:clock")]
    return statistics.median(ratios) if ratios else None


def int8_peak(probe: dict, prefix: str = "") -> float:
    """The fastest int8 multiply-add this CPU has (VNNI where present, else the AVX2 chain); prefix
    "cpu:" for the CPU-time rates."""
    return max(probe[prefix + k] for k in INT8 if probe.get(prefix + k))


def summarize(rounds: list[dict]) -> dict:
    """{probe: {"median", "best"}} over rounds (the best: other load only lowers a probe)."""
    out = {}
    for name in rounds[0]:
        values = [r[name] for r in rounds if r.get(name)]
        if values:
            out[name] = {"median": statistics.median(values), "best": max(values)}
    return out


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("flags"):
            return line
    return platform.processor()


def cpu_model() -> str:
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "n/a"


# ---- the arithmetic ---------------------------------------------------------------------
def gguf_costs(path: Path) -> dict:
    """What one token costs on the file: see tensor_costs."""
    from gguf import GGUFReader

    from services.core.gguf_file import read_metadata
    tensors = [(t.name, [int(n) for n in t.shape], int(t.n_elements), int(t.n_bytes))
               for t in GGUFReader(str(path)).tensors]
    return tensor_costs(tensors, read_metadata(path))


def tensor_costs(tensors: list[tuple[str, list[int], int, int]], meta: dict) -> dict:
    """tensors: (name, shape in ggml order [n_in, n_out, experts], elements, bytes) -> {
      decode_bytes   bytes one batch-1 decode token reads (the embedding's one row; all of it where
                     the output layer is the embedding; experts by used / count)
      linear_macs    multiply-adds per token of the linear layers (active experts only), output left out
      output_macs    the output layer's multiply-adds (one token's logits)
      attention      (layers, heads, key_length + value_length): attention's multiply-adds per token at
                     context c are layers x heads x (key + value length) x c
      active_fraction  used / count experts (1 for a dense model)}"""
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    key = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    value = meta.get(f"{arch}.attention.value_length", key)
    experts = meta.get(f"{arch}.expert_count") or 0
    active = meta[f"{arch}.expert_used_count"] / experts if experts else 1.0
    names = {name for name, *_ in tensors}
    tied = "output.weight" not in names
    decode_bytes = linear_macs = output_macs = 0.0
    for name, shape, elements, nbytes in tensors:
        if name == "token_embd.weight":
            decode_bytes += nbytes if tied else nbytes / shape[1]  # the lm_head reads it all; a lookup, one row
            output_macs += elements if tied else 0
        elif name == "output.weight":
            decode_bytes += nbytes
            output_macs += elements
        elif "_exps." in name:  # [n_in, n_out, experts]: a token reads and multiplies its routed experts
            decode_bytes += nbytes * active
            linear_macs += elements * active
        else:
            decode_bytes += nbytes
            linear_macs += elements if len(shape) == 2 else 0  # 1-D: norms, rope factors
    return {"decode_bytes": decode_bytes, "linear_macs": linear_macs, "output_macs": output_macs,
            "attention": (meta[f"{arch}.block_count"], heads, key + value), "active_fraction": active}


def prefill_macs_per_token(costs: dict, prompt: int) -> float:
    """Multiply-adds per prompt token of one `prompt`-token prefill: linear layers, the output once per
    prompt (the last token's logits), attention at the causal mean context (prompt + 1) / 2."""
    layers, heads, qk_pv = costs["attention"]
    return costs["linear_macs"] + costs["output_macs"] / prompt + layers * heads * qk_pv * (prompt + 1) / 2


def bounds(costs: dict, read_bytes_per_s: float, int8_macs_per_s: float, prompt: int) -> dict:
    """{"decode": tok/s, "prefill": tok/s}: the most this machine's bandwidth and int8 peak allow."""
    return {"decode": read_bytes_per_s / costs["decode_bytes"],
            "prefill": int8_macs_per_s / prefill_macs_per_token(costs, prompt)}


def against_bound(bound: float, peer: float, ours: float, target: float) -> dict:
    """Each contender's fraction of the bound, and the target's (target x the peer's tok/s)."""
    need = target * peer
    return {"bound": bound, "peer_fraction": peer / bound, "ours_fraction": ours / bound,
            "target_tok_s": need, "target_fraction": need / bound}


def verdict(row: dict, target: float) -> str:
    """Above or within the bound (the best probe's); where given, the bound at the median probe too."""
    need = row["target_fraction"]
    median = row.get("target_fraction_median")
    at_median = "" if median is None else f"; {_pct(median)} of the median probe's bound"
    if need > 1:
        return f"above the limit: {target:g}x llama.cpp is {need:.2f}x the bound{at_median}"
    return (f"reachable in principle: {target:g}x llama.cpp is {_pct(need)} of the bound "
            f"(llama.cpp at {_pct(row['peer_fraction'])}){at_median}")


# ---- contenders against the bounds --------------------------------------------------------
TARGETS = {"decode": 1.5, "prefill": 3.0}  # the engine over llama.cpp, issue 41


def phase_figures(values: dict, prompt: int) -> dict:
    """{"decode" | "prefill": (llama.cpp's median tok/s, the engine's best contender, its median)} from
    bench/quant.py's section_actquant values; a phase without llama-bench is left out."""
    out = {}
    for phase, prefix in (("decode", "decode"), ("prefill", f"prefill {prompt}")):
        medians = {k[len(prefix):].strip(): statistics.median(v) for k, v in values.items() if k.startswith(prefix)}
        peers = [v for k, v in medians.items() if k.startswith("(l)")]
        ours = [(v, k) for k, v in medians.items() if "GGUF" in k]
        if peers and ours:
            out[phase] = (peers[0], *reversed(max(ours)))
    return out


def file_limits(gguf: Path, actquant: dict, prompt: int, threads: int, quiet: dict | None = None,
                more_probes: list[dict] = (), conditions: tuple[str, ...] = ("loaded", "quiet"),
                label: str | None = None) -> list[dict]:
    """Per phase, twice: under the run's load (the bound from the wall-time probes interleaved with the
    contenders, best and median, against the contenders of the same run) and on the quiet machine (the
    bound from the CPU-time probes, against `quiet`'s figures where given: {"values": an earlier quiet
    run's section_actquant values, "label": where they come from}; else this run's). Each with
    llama.cpp's and the engine's best contender's tok/s and fractions of the bound, and the target's;
    for prefill on the quiet machine also the clock per core that the target (and llama.cpp) would need
    with every cycle of the `threads` cores issuing int8 multiply-adds at the probe's per-cycle rate.
    more_probes: standalone probe rounds on `threads` threads, for the quiet bound only; label: the
    file's name in the rows (default: the GGUF's)."""
    costs = gguf_costs(gguf)
    probes = [*actquant["probes"], *more_probes]
    macs = prefill_macs_per_token(costs, prompt)
    kind = max((k for k in INT8 if probes[0].get(k)), key=lambda k: probes[0][k])
    cycle = per_cycle(probes, kind)
    rows = []
    for condition, prefix, values, source in (
            ("loaded", "", actquant["values"], "this run"),
            ("quiet", "cpu:", (quiet or {}).get("values", actquant["values"]), (quiet or {}).get("label", "this run"))):
        if condition not in conditions:
            continue
        used = probes if condition == "quiet" else actquant["probes"]  # loaded: those beside the contenders only
        int8 = [int8_peak(p, prefix) for p in used]
        reads = [p[prefix + "read"] for p in used]
        for phase, (peer, name, ours) in phase_figures(values, prompt).items():
            at = {level: bounds(costs, pick(reads), pick(int8), prompt)[phase]
                  for level, pick in (("median", statistics.median), ("best", max))}
            row = against_bound(at["best"], peer, ours, TARGETS[phase])
            row["target_fraction_median"] = row["target_tok_s"] / at["median"]
            if phase == "prefill" and cycle and condition == "quiet":
                row.update(int8_per_cycle=cycle, target_ghz=row["target_tok_s"] * macs / (cycle * threads) / 1e9,
                           peer_ghz=peer * macs / (cycle * threads) / 1e9)
            rows.append({"file": label or gguf.name, "phase": "decode" if phase == "decode" else f"pp{prompt}",
                         "condition": condition, "figures_from": source, "bound_median_probe": at["median"],
                         "ours_name": name, "ours": ours, "peer": peer, "target": TARGETS[phase], **row,
                         "verdict": verdict(row, TARGETS[phase]), "decode_bytes": costs["decode_bytes"],
                         "macs_per_token": macs,
                         "read_bytes_per_s": {"median": statistics.median(reads), "best": max(reads)},
                         "int8_macs_per_s": {"median": statistics.median(int8), "best": max(int8)}})
    return rows


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%" if fraction >= 0.01 else f"{100 * fraction:.1f}%"


def limits_table(rows: list[dict]) -> str:
    from common import markdown_table
    return markdown_table(
        ["file", "phase", "machine (figures from)", "bound tok/s (best probe; median)", "llama.cpp tok/s (of bound)",
         "engine best tok/s (of bound)", "target tok/s (of bound)", "verdict"],
        [[r["file"], r["phase"], f"{r['condition']} ({r['figures_from']})",
          f"{r['bound']:.0f} ({r['bound_median_probe']:.0f})",
          f"{r['peer']:.1f} ({_pct(r['peer_fraction'])})",
          f"{r['ours']:.1f} ({_pct(r['ours_fraction'])}) {r['ours_name']}",
          f"{r['target_tok_s']:.0f} ({_pct(r['target_fraction'])})", r["verdict"]] for r in rows])


def limits_text(rows: list[dict]) -> str:
    """The bounds' inputs under the table: bytes and multiply-adds per token, the probes used."""
    lines = []
    for r in rows:
        if r["phase"] == "decode":
            lines.append(f"- {r['file']}, {r['condition']}: decode reads {r['decode_bytes'] / 1e6:.1f} MB per token at "
                         f"{r['read_bytes_per_s']['best'] / 1e9:.1f} GB/s (median probe "
                         f"{r['read_bytes_per_s']['median'] / 1e9:.1f})")
        else:
            lines.append(f"- {r['file']}, {r['condition']}: {r['phase']} takes {r['macs_per_token'] / 1e6:.0f} M "
                         f"multiply-adds per token at {2 * r['int8_macs_per_s']['best'] / 1e12:.2f} int8 TOPS "
                         f"(median probe {2 * r['int8_macs_per_s']['median'] / 1e12:.2f})"
                         + (f"; at {r['int8_per_cycle']:.0f} int8 multiply-adds per cycle per core, the target needs "
                            f"every core at {r['target_ghz']:.2f} GHz issuing nothing but them (llama.cpp's "
                            f"{r['peer']:.1f} tok/s: {r['peer_ghz']:.2f} GHz)" if "target_ghz" in r else ""))
    return "\n".join(lines) + "\n"


# ---- the run ------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    from common import add_cpu_isa
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="GGUF files or folders (what --model takes); none: probes only")
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-bench (default: $LLAMA_CPP_DIR)")
    parser.add_argument("--threads", type=int, default=2, help="the contenders' threads (and their probes')")
    parser.add_argument("--probe-threads", default="1,2", help="the standalone probes' thread counts")
    parser.add_argument("--probe-repeats", type=int, default=3, help="standalone probe rounds, before and after")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the contenders; medians reported")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--kv-blocks", type=int, default=None, help="each engine's KV-cache blocks (gguf_speed.py's)")
    parser.add_argument("--quiet-results", nargs="*", default=[],
                        help="a bench/gguf_speed.py results json from a quieter hour: its llama.cpp and engine "
                             "figures are placed against the quiet machine's bounds too")
    parser.add_argument("--bounds-only", nargs="*", default=[], metavar="GGUF",
                        help="files whose bounds alone are given (no contenders run), at the standalone probes "
                             "on --threads threads; with --quiet-results, its figures for them are placed too")
    parser.add_argument("--report-from", default=None, metavar="JSON",
                        help="no measuring: the report again from an earlier run's results json (its probes and "
                             "contenders; the models argument and --bounds-only as given now)")
    parser.add_argument("--out", default="machine_limits")
    add_cpu_isa(parser)
    return parser.parse_args()


def standalone(threads: list[int], repeats: int) -> dict[int, list[dict]]:
    """{threads: [probe_round]}: the thread counts interleaved, repeats times."""
    rounds: dict[int, list[dict]] = {t: [] for t in threads}
    for _ in range(repeats):
        for t in threads:
            rounds[t].append(probe_round(t))
    return rounds


def probe_table(rounds: dict[int, list[dict]]) -> str:
    from common import markdown_table
    threads = sorted(rounds)
    stats = {t: summarize(rounds[t]) for t in threads}
    rows = []
    for kind, what in [*COMPUTE.items(), ("clock", "dependent adds (cycles, summed over the threads)"),
                       ("read", f"read bandwidth ({READ_MIB} MiB sum; wall: or roofline.py's probe)")]:
        unit = {"read": "GB/s", "clock": "GHz"}.get(kind, "G multiply-adds/s")
        cells = []
        for t in threads:
            for key in (kind, f"cpu:{kind}"):
                s = stats[t].get(key)
                cells.append("unsupported" if s is None else f"{s['median'] / 1e9:.1f} ({s['best'] / 1e9:.1f})")
            ratio = per_cycle(rounds[t], kind) if kind in COMPUTE else None
            cells.append("" if ratio is None else f"{ratio:.1f}")
        rows.append([kind, what, unit, *cells])
    headers = [h for t in threads for h in (f"{t} thread{'s' * (t > 1)}: wall", "on CPU", "per cycle per core")]
    return markdown_table(["probe", "runs", "unit", *headers], rows)


def quiet_figures(paths: list[str], gguf: Path) -> dict | None:
    """An earlier, quieter run's actquant values for this file: the first of the bench/gguf_speed.py
    results jsons that has it."""
    import json
    for path in paths:
        data = json.loads(Path(path).read_text())
        for f in data["files"]:
            if "actquant" in f and (Path(f["model"]).name in (gguf.name, gguf.parent.name) or f["file"] == gguf.name):
                return {"values": f["actquant"]["values"],
                        "label": f"{Path(path).name}, load {data['loadavg_before'].split()[0]}"}
    return None


def main() -> None:
    import gguf_speed
    import llamacpp
    import quant
    from common import loadavg, markdown_table, select_tier, show_results
    args = parse_args()
    load_before = loadavg()
    args.tier = select_tier(args.cpu_isa, args.libraries_isa)
    threads = [int(t) for t in args.probe_threads.split(",")]
    flags = set(cpu_flags().split())
    if args.report_from:  # the figures of an earlier run, the report made again (the bounds' code may be newer)
        import json
        saved = json.loads(Path(args.report_from).read_text())
        before, after = ({int(t): v for t, v in saved[key].items()} for key in ("probes_before", "probes_after"))
        results, load_before = saved["files"], saved["loadavg_before"]
        args.models = []
    else:
        before = standalone(threads, args.probe_repeats)
        print(probe_table(before), flush=True)
        results = []
    if args.models:
        args.sections = "actquant"
        if args.kv_blocks:
            quant.ENGINE_DEFAULTS["num_gpu_blocks"] = args.kv_blocks
        bench_bin = llamacpp.binary(args.llama_cpp_dir, "llama-bench")
        for model in args.models:
            results.append(gguf_speed.one_file(model, args, bench_bin, (None, "not used")))
            gc.collect()  # the file's two engines, before the next file's: this host has little memory to spare
    if not args.report_from:
        after = standalone(threads, args.probe_repeats)
    rows = [row for r in results if "probes" in r.get("actquant", {})
            for gguf in [gguf_speed.gguf_path(gguf_speed.model_path(r["model"]))]
            for row in file_limits(gguf, r["actquant"], args.prefill_len, args.threads,
                                   quiet_figures(args.quiet_results, gguf),
                                   before.get(args.threads, []) + after.get(args.threads, []), label=r["file"])]
    for path in args.bounds_only:  # the bounds alone, at the standalone probes; an earlier run's figures placed
        gguf = gguf_speed.gguf_path(gguf_speed.model_path(path))
        figures = quiet_figures(args.quiet_results, gguf) or {"values": {}, "label": "no run"}
        standalone_probes = before.get(args.threads, []) + after.get(args.threads, [])
        rows += file_limits(gguf, {"probes": standalone_probes, "values": figures["values"]}, args.prefill_len,
                            args.threads, figures, conditions=("quiet",), label=Path(path).name)
    parts = ([f"Measured by `{saved['command']}` at {saved['commit']} (load before, after: {saved['loadavg_before']}; "
              f"{saved['loadavg_after']}); this report made again from its json.\n"] if args.report_from else [])
    parts += [f"CPU: {cpu_model()} (/proc/cpuinfo model name; {os.cpu_count()} CPUs); avx512_vnni: "
             f"{'yes' if 'avx512_vnni' in flags else 'no'}, avx512f: {'yes' if 'avx512f' in flags else 'no'}, "
             f"amx_int8: {'yes' if 'amx_int8' in flags else 'no'}, avx2: {'yes' if 'avx2' in flags else 'no'}.\n",
             "## The machine's limits\n\nStandalone probes, before and after the contenders "
             f"({args.probe_repeats} rounds each, thread counts interleaved): median (best). wall: the rate over "
             "wall time, what a program got under the load of the moment; on CPU: over the threads' own CPU time, "
             "the rate of cores nobody else held (the quiet machine's; for reads an upper estimate, since threads "
             "that ran at different times did not share the memory system); per cycle: on CPU over the clock "
             "probe's cycles. int8 TOPS = 2 x multiply-adds/s.\n",
             probe_table({t: before[t] + after[t] for t in threads})]
    if rows:
        parts += ["## Each target against the bound\n\n"
                  + ("" if not results else f"The contenders ran on {args.threads} threads, {args.rounds} round(s), "
                     f"a round of probes on {args.threads} threads between them in each round (bench/gguf_speed.py's "
                     "actquant section). ")
                  + "loaded: the bound from those probes' wall rates, against this run's contenders; quiet: the bound "
                  f"from every {args.threads}-thread probe's CPU-time rates, against "
                  + (f"the figures of {', '.join(Path(p).name for p in args.quiet_results)} (earlier runs)"
                     if args.quiet_results else "this run's contenders") + ".\n",
                  limits_table(rows), limits_text(rows), "### Verdicts\n",
                  "\n".join(f"- {r['file']} {r['phase']}, {r['condition']} machine ({r['figures_from']}): "
                            f"{r['verdict']}" for r in rows) + "\n"]
        for r in results:
            if "actquant" in r:
                parts.append(f"### {r['file']}: the contenders\n\n" + markdown_table(
                    ["contender", "tok/s (median)", "each round", "vs baseline"], quant.rows_for(r["actquant"])))
    show_results(args.out, "This machine's limits, and each speed target against them", load_before,
                 "\n".join(parts), {"probes_before": before, "probes_after": after, "files": results,
                                    "limits": rows})


if __name__ == "__main__":
    main()
