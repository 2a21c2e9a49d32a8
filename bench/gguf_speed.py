"""Speed per GGUF type: bench/quant.py's actquant and serve sections over a list of GGUF files, each
against llama.cpp on the same file and threads, contenders interleaved round by round.

    python bench/gguf_speed.py A.Q4_K_M.gguf B.Q6_K.gguf ... --llama-cpp-dir /path/to/llama.cpp/build/bin
    python bench/gguf_speed.py default --rounds 1 --decode-steps 4 --prefill-len 32 --num-requests 2 --max-output-len 4

Each argument is what --model takes (a GGUF file, a folder with config.json and one GGUF, or
"default"). Per file, one after the other:
  actquant  batch-1 decode and the prefill of one --prefill-len (512) token prompt, the engine with
            fp32 and with int8 activations, against llama-bench's tg and pp512 (targets, issue 41:
            decode >= 1.5x, pp512 >= 3x llama-bench); a round of bench/machine_limits.py's probes
            between them gives each phase's bound on this machine (decode: read bandwidth over the
            bytes a token reads; prefill: int8 peak over the multiply-adds) and each contender's
            fraction of it, and the target's
  serve     --num-requests (16) concurrent ShareGPT requests, the engine with each
            --serve-activations mode, against llama-server with as many slots (target >= 3x)
A type the engine does not serve yet is reported as refused (its message), not a crash. The
summary table gives each engine contender's median over llama.cpp's median; the sections' own
tables (every round) follow it. Writes bench/results/<--out>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
import quant  # noqa: E402
from common import add_cpu_isa, loadavg, markdown_table, select_tier, show_results  # noqa: E402
from gguf_files import gguf_path, mix_text, model_path, type_label  # noqa: E402
from workload import add_workload_flags, describe  # noqa: E402

TARGETS = {"decode": 1.5, "prefill": 3.0, "serve": 3.0}  # engine over llama.cpp, issue 41


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="GGUF files or folders (what --model takes), or 'default'")
    add_workload_flags(parser)
    parser.set_defaults(num_requests=16, single_requests=0, serve_dtypes="float32")
    parser.add_argument("--sections", default="actquant,serve")
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-bench and llama-server "
                                                               "(default: $LLAMA_CPP_DIR)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--serve-activations", default="int8,none",
                        help="serve: the engine's contenders, one per activation mode")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="each engine's KV-cache blocks (default: the engine's); fewer hold less memory "
                             "where two engines of a large file share the host")
    parser.add_argument("--out", default="gguf_speed")
    add_cpu_isa(parser)
    return parser.parse_args()


def one_file(argument: str, args, bench_bin, server_bin) -> dict:
    from services.core.errors import InvalidArgument
    model = model_path(argument)
    gguf = gguf_path(model)
    result = {"model": argument, "file": gguf.name if argument == "default" else Path(argument).name, "type": type_label(gguf), "tensors": mix_text(gguf)}
    print(f"== {argument}: {result['type']} ({result['tensors']})", flush=True)
    args.model = argument  # the serve section's ShareGPT prompts, in this file's tokenizer
    try:
        for section in args.sections.split(","):
            if section == "actquant":
                result[section] = quant.section_actquant(model, args, bench_bin)
            elif section == "serve":
                result[section] = quant.section_serve(model, args, server_bin)
            else:
                raise SystemExit(f"unknown section {section!r} (actquant, serve)")
            print(result[section], flush=True)
    except InvalidArgument as refused:
        result["refused"] = str(refused)
    return result


def ratios(values: dict, phase: str, peer_mark: str) -> dict[str, tuple[float, float, float]]:
    """{engine contender: (its median, llama.cpp's median, ratio)} among the keys starting with `phase`."""
    keys = [k for k in values if k.startswith(phase)]
    peer = next((k for k in keys if peer_mark in k), None)
    if peer is None:
        return {}
    base = statistics.median(values[peer])
    return {k[len(phase):].strip(): (statistics.median(values[k]), base, statistics.median(values[k]) / base)
            for k in keys if "GGUF" in k}  # the engine's contenders (quant.kind names the file's type)


def summary_rows(result: dict, args) -> list[list]:
    if "refused" in result:
        return [[result["file"], result["type"], "not served", result["refused"], ""]]
    rows = []
    phases = []  # (label, {engine contender: (ours, theirs, ratio)}, target)
    if "actquant" in result:
        values = result["actquant"]["values"]
        phases += [("decode", ratios(values, "decode", "(l)"), TARGETS["decode"]),
                   (f"pp{args.prefill_len}", ratios(values, f"prefill {args.prefill_len}", "(l)"), TARGETS["prefill"])]
    if "serve" in result:
        phases.append((f"{args.num_requests} concurrent", ratios(result["serve"]["values"], "", "(s)"),
                       TARGETS["serve"]))
    for phase, found, target in phases:
        for name, (ours, theirs, ratio) in found.items():
            met = "met" if ratio >= target else "**missed**"
            rows.append([result["file"], result["type"], phase, name,
                         f"**{ratio:.2f}x** ({ours:.1f} vs {theirs:.1f} tok/s; >= {target:g}x: {met})"])
    return rows


def limit_rows(results: list[dict], args) -> list[dict]:
    """bench/machine_limits.py's bounds per file and phase, from the probes interleaved with the contenders."""
    from machine_limits import file_limits
    return [row for r in results if "probes" in r.get("actquant", {})
            for row in file_limits(gguf_path(model_path(r["model"])), r["actquant"], args.prefill_len, args.threads,
                                   label=r["file"])]


def limits_part(results: list[dict], args) -> str:
    from machine_limits import limits_table, limits_text
    rows = limit_rows(results, args)
    if not rows:
        return ""
    return ("### Against this machine's limits (bench/machine_limits.py)\n\nThe most each phase can reach here: "
            "decode at the read bandwidth over the bytes one token reads, prefill at the int8 multiply-add peak "
            "over the multiply-adds per token; probed once per round between the contenders, the best probe "
            "taken (the median's bound in brackets). Fractions are of the best-probe bound.\n\n"
            + limits_table(rows) + "\n" + limits_text(rows))


def report(results: list[dict], args) -> str:
    rows = [row for r in results for row in summary_rows(r, args)]
    parts = [f"Threads: {args.threads}; rounds: {args.rounds} (contenders interleaved in each round, files one after "
             f"the other); CPU kernel tier: {args.tier}; serve workload: {describe(args)}. Ratios: the engine's median "
             "over llama.cpp's (llama-bench tg and pp, llama-server with as many slots as requests) on the same file.\n",
             markdown_table(["file", "type", "phase", "engine contender", "vs llama.cpp"], rows),
             "Tensor types (the norms' F32 left out):\n\n"
             + "\n".join(f"- {r['file']} ({r['type']}): {r['tensors']}" for r in results) + "\n",
             limits_part(results, args)]
    for r in results:
        for section in ("actquant", "serve"):
            if section in r:
                parts.append(f"### {r['file']}: {section}\n\n" + markdown_table(
                    ["contender", "tok/s (median)", "each round", "vs baseline"], quant.rows_for(r[section])))
    return "\n".join(parts)


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    args.tier = select_tier(args.cpu_isa, args.libraries_isa)
    if args.kv_blocks:
        quant.ENGINE_DEFAULTS["num_gpu_blocks"] = args.kv_blocks
    bench_bin = llamacpp.binary(args.llama_cpp_dir, "llama-bench")
    server_bin = llamacpp.binary(args.llama_cpp_dir, "llama-server")
    results = [one_file(model, args, bench_bin, server_bin) for model in args.models]
    show_results(args.out, "Speed per GGUF type against llama.cpp on the same file", load_before,
                 report(results, args), {"files": results})


if __name__ == "__main__":
    main()
