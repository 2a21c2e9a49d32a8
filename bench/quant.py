"""Quantized weights: the engine on a GGUF (the default model's own Q4_1, or --model FILE.gguf / a
folder with one) against llama.cpp on the same file, and int8 against bf16. One run, contenders
interleaved round by round, same threads. bench/gguf_speed.py runs it over a list of GGUF files.

    python bench/quant.py --llama-cpp-dir /path/to/llama.cpp/build/bin     # everything
    python bench/quant.py --sections decode,int8                           # no llama.cpp needed
    python bench/quant.py --sections actquant --model x.Q6_K.gguf --llama-cpp-dir ...   # any GGUF file

Sections:
  decode    batch-1 decode tok/s: (a) the engine on the GGUF (--quantization gguf, fp32 activations)
            and (b) with bf16 activations, against (l) llama-bench's tg on the same file
  int8      batch-1 decode tok/s of the default model with bf16 activations: int8 weights
            (--quantization int8) against bf16 weights; greedy tokens of int8 (fp32 activations)
            against the fp32 weights, per chat prompt
  serve     --num-requests (16) concurrent ShareGPT requests: the engine on the GGUF, all at once (one
            contender per --serve-activations mode: none, int8);
            llama-server with 16 slots, all at once; llama.cpp one request at a time (llama-server
            with 1 slot) and (p) llama-cpp-python one at a time (the baseline where it imports:
            bench/requirements-llamacpp.txt; else llama-server with 1 slot stands in), both on
            the first --single-requests requests (0: neither; llama-server with 16 slots is then
            the baseline); and the most tok/s fp32 arithmetic allows on
            this workload here (fp32_ceiling: its linear layers' FLOPs at the machine's best fp32
            matmul rate, the same threads)
  actquant  the default model's GGUF (fp32), fp32 activations (--activation-quant none) against int8
            activations (int8, kernels/csrc/quant_dot.c), interleaved: batch-1 decode tok/s and the
            prefill of one --prefill-len (512) token prompt in tok/s; the CPU tier named (--cpu-isa
            forces one). llama-bench's tg and pp512 on the same file join as (l) where --llama-cpp-dir
            is given (the AVX2 build's folder with --cpu-isa avx2); each round probes the machine's
            limits (bench/machine_limits.py: read bandwidth, int8 and fp32 peaks) for the batch-1
            roofline (linear weight bytes over bandwidth) and bench/gguf_speed.py's bounds
Greedy parity with llama-server on the same file, for both activation modes, is
bench/activation_quality.py's. Engine decode is timed on engine.step() with one request in flight
after its prefill (as bench/roofline.py does); llama-bench generates from an empty context. Writes
bench/results/quant.{md,json}.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
from gguf_files import type_label  # noqa: E402
from common import add_cpu_isa, engine_tier_args, loadavg, markdown_table, select_tier, write_results  # noqa: E402
from workload import add_workload_flags, load_workload, model_folder, summary  # noqa: E402

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
         "Explain what a CPU cache is in two sentences.", "Give me a recipe for pancakes.",
         "What is 17 times 23?", "Translate 'good morning' into Spanish.", "Name the planets of the solar system."]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.set_defaults(num_requests=16)
    parser.add_argument("--sections", default="decode,int8,serve")
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-bench and llama-server "
                                                               "(default: $LLAMA_CPP_DIR)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--single-requests", type=int, default=4)
    parser.add_argument("--parity-tokens", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--serve-activations", default="none",
                        help="serve: the engine's contenders, one per activation mode (none, int8 or none,int8)")
    parser.add_argument("--serve-dtypes", default="float32",
                        help="serve: the engine's activation and KV-cache dtypes, each with every activation mode "
                             "(float32, bfloat16 or both; the checkpoint's, bfloat16, is what dtype auto runs)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="each engine's KV-cache blocks (default: the engine's); fewer hold less memory")
    parser.add_argument("--out", default="quant")
    add_cpu_isa(parser)
    return parser.parse_args()


def gguf_file(folder: Path) -> Path:
    from services.worker.gguf_weights import find_gguf_file
    return find_gguf_file(folder)


def kind(folder: Path) -> str:
    """The contenders' label for the model's GGUF: "GGUF Q4_1", "GGUF Q4_K_M", ..."""
    return f"GGUF {type_label(gguf_file(folder))}"


def random_ids(llm, rng: random.Random, length: int) -> list[int]:
    """Token ids past the first 16 (special tokens) and inside the model's vocabulary."""
    high = min(49000, llm.tokenizer.vocab_size)
    return [rng.randrange(16, high) for _ in range(length)]


ENGINE_DEFAULTS: dict = {}  # engine settings a caller sets for every engine here (gguf_speed.py --kv-blocks)


def engine(folder: Path, **kwargs):
    from pagedserve import LLM
    return LLM(str(folder), seed=0, enable_prefix_caching=False, **{**engine_tier_args(), **ENGINE_DEFAULTS, **kwargs})


def decode_rate(llm, steps: int, tag: str) -> float:
    """Batch-1 decode tokens/s: one request in flight, after its prefill and one warm-up step."""
    from pagedserve import SamplingParams
    rng = random.Random(0)
    prompt = random_ids(llm, rng, 16)
    llm.scheduler.add_request(f"{tag}-{time.monotonic_ns()}", prompt,
                              SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    rate = steps / (time.perf_counter() - start)
    while llm.scheduler.has_unfinished():  # the last few tokens, so the next round starts empty
        llm.engine.step()
    return rate


def interleave(contenders: dict, rounds: int) -> dict:
    """{name: fn() -> value}: one call of each in turn, `rounds` times -> {name: [values]}."""
    values = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            values[name].append(fn())
    return values


def section_decode(folder: Path, args, llama_bench) -> dict:
    gguf = gguf_file(folder)
    fp32 = engine(folder, quantization="gguf", dtype="float32", num_threads=args.threads, activation_quant="none")
    bf16 = engine(folder, quantization="gguf", dtype="bfloat16", num_threads=args.threads, activation_quant="none")
    contenders = {f"(a) engine, {kind(folder)}, fp32 activations": lambda: decode_rate(fp32, args.decode_steps, "a"),
                  f"(b) engine, {kind(folder)}, bf16 activations": lambda: decode_rate(bf16, args.decode_steps, "b")}
    skipped = {}
    if llama_bench[0] is not None:
        contenders["(l) llama.cpp llama-bench, same file"] = lambda: llamacpp.bench_decode(
            llama_bench[0], gguf, args.threads, args.decode_steps)
    else:
        skipped["(l) llama.cpp llama-bench, same file"] = llama_bench[1]
    return {"values": interleave(contenders, args.rounds), "skipped": skipped, "baseline": "(l) llama.cpp "
            "llama-bench, same file"}


def prefill_rate(llm, length: int, tag: str) -> float:
    """Tokens/s of one prompt of `length` tokens taken in one step (nothing cached), then finished."""
    from pagedserve import SamplingParams
    rng = random.Random(1)
    prompt = random_ids(llm, rng, length)
    llm.scheduler.add_request(f"{tag}-{time.monotonic_ns()}", prompt,
                              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    llm.engine.step()
    rate = length / (time.perf_counter() - start)
    while llm.scheduler.has_unfinished():
        llm.engine.step()
    return rate


def section_actquant(folder: Path, args, llama_bench) -> dict:
    from kernels import cpu_kernels
    from machine_limits import probe_round
    from roofline import linear_weight_bytes
    kw = dict(quantization="gguf", dtype="float32", num_threads=args.threads,
              max_num_batched_tokens=max(2048, args.prefill_len))
    fp32 = engine(folder, activation_quant="none", **kw)
    int8 = engine(folder, activation_quant="int8", **kw)
    fp32_name, int8_name = f"(a) {kind(folder)}, fp32 activations", f"(i) {kind(folder)}, int8 activations"
    decode = {fp32_name: lambda: decode_rate(fp32, args.decode_steps, "a"),
              int8_name: lambda: decode_rate(int8, args.decode_steps, "i")}
    prefill = {fp32_name: lambda: prefill_rate(fp32, args.prefill_len, "a"),
               int8_name: lambda: prefill_rate(int8, args.prefill_len, "i")}
    skipped = {}
    if llama_bench[0] is not None:
        decode["(l) llama.cpp llama-bench tg, same file"] = lambda: llamacpp.bench_decode(
            llama_bench[0], gguf_file(folder), args.threads, args.decode_steps)
        prefill[f"(l) llama.cpp llama-bench pp{args.prefill_len}, same file"] = lambda: llamacpp.bench_prefill(
            llama_bench[0], gguf_file(folder), args.threads, args.prefill_len)
    else:
        skipped["(l) llama.cpp llama-bench, same file"] = llama_bench[1]
    probes = []
    contenders = {**{f"decode {k}": v for k, v in decode.items()},
                  **{f"prefill {args.prefill_len} {k}": v for k, v in prefill.items()},
                  # the machine's limits under the same load (bench/machine_limits.py): int8 peak, read bandwidth
                  "machine probes": lambda: probes.append(probe_round(args.threads)) or 0.0}
    values = interleave(contenders, args.rounds)
    values.pop("machine probes")
    weight_bytes = linear_weight_bytes(int8.engine.workers["worker-0"].runner.model)
    best = statistics.median(values[f"decode {int8_name}"])
    read = statistics.median(p["read"] for p in probes)
    roofline = {"weight_bytes": weight_bytes, "bandwidth_bytes_per_s": read, "bound_tok_per_s": read / weight_bytes}
    roofline["fraction_int8"] = best / roofline["bound_tok_per_s"]
    return {"values": values, "skipped": skipped, "baseline": f"decode {fp32_name}",
            "tier": cpu_kernels.active_tier(), "roofline": roofline, "probes": probes}


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    from pagedserve import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs),
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def chat_prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]


def compare(got, want) -> dict:
    """Token-equal, or the first differing position and our top-2 logprob gap there."""
    for i, (a, b) in enumerate(zip(got.token_ids, want)):
        if a != b:
            gap = None
            if got.logprobs and i < len(got.logprobs) and len(got.logprobs[i].top) > 1:
                top = got.logprobs[i].top
                gap = top[0][1] - top[1][1]
            return {"equal": False, "first_divergence": i, "our_top2_logprob_gap": gap, "compared": len(want)}
    n = min(len(got.token_ids), len(want))
    return {"equal": len(got.token_ids) == len(want), "compared": n,
            **({} if len(got.token_ids) == len(want) else {"lengths": [len(got.token_ids), len(want)]})}


def section_int8(folder: Path, args) -> dict:
    bf16 = engine(folder, quantization="none", dtype="bfloat16", num_threads=args.threads)
    # activation_quant none: the activations the labels name, whatever auto means (docs/guide/models.md, 'Int8 activations')
    int8 = engine(folder, quantization="int8", dtype="bfloat16", num_threads=args.threads, activation_quant="none")
    values = interleave({"(c) bf16 weights, bf16 activations": lambda: decode_rate(bf16, args.decode_steps, "c"),
                         "(d) int8 weights, bf16 activations": lambda: decode_rate(int8, args.decode_steps, "d")},
                        args.rounds)
    del bf16, int8
    fp32 = engine(folder, quantization="none", dtype="float32", num_threads=args.threads)
    int8_fp32 = engine(folder, quantization="int8", dtype="float32", num_threads=args.threads, activation_quant="none")
    prompts = chat_prompts(fp32)
    want = greedy_tokens(fp32, prompts, args.parity_tokens)
    got = greedy_tokens(int8_fp32, prompts, args.parity_tokens, logprobs=2)
    return {"values": values, "baseline": "(c) bf16 weights, bf16 activations",
            "greedy_vs_fp32": [compare(g, w.token_ids) for g, w in zip(got, want)]}


def section_serve(folder: Path, args, server_bin) -> dict:
    from pagedserve import SamplingParams
    requests = load_workload(args)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]

    def ours(llm) -> float:
        start = time.perf_counter()
        outs = llm.generate([list(r.prompt_ids) for r in requests], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    contenders = {}
    for dtype in args.serve_dtypes.split(","):
        for mode in args.serve_activations.split(","):
            llm = engine(folder, quantization="gguf", dtype=dtype, num_threads=args.threads,
                         max_num_seqs=len(requests), activation_quant=mode)
            ours(llm)  # warm-up
            name = (f"(e) engine, {kind(folder)}, all at once" + ("" if mode == "none" else f", {mode} activations")
                    + ("" if dtype == "float32" else f", {dtype}"))
            contenders[name] = lambda llm=llm: ours(llm)
    skipped, servers = {}, []
    first = requests[:args.single_requests]
    many_name = f"(s) llama-server, {len(requests)} slots"
    peer, why = llamacpp.bindings(args.llama_cpp_dir) if first else (None, "--single-requests 0")
    if peer is None:
        skipped["(p) llama-cpp-python, one at a time"] = why
    else:
        bound = peer(gguf_file(folder), args.threads)
        bound.run(first[:1])  # warm-up
        contenders["(p) llama-cpp-python, one at a time"] = lambda: _rate(*bound.run(first))
    if server_bin[0] is None:
        skipped[many_name] = skipped["(o) llama.cpp, one at a time"] = server_bin[1]
    else:
        many = llamacpp.Server(server_bin[0], gguf_file(folder), args.threads, slots=len(requests))
        servers = [many]
        many.run(requests[:2], concurrent=True)
        contenders[many_name] = lambda: _rate(*many.run(requests, concurrent=True))
        if first:
            one = llamacpp.Server(server_bin[0], gguf_file(folder), args.threads, slots=1)
            servers.append(one)
            contenders["(o) llama.cpp, one at a time"] = lambda: _rate(*one.run(first, concurrent=False))
        else:
            skipped["(o) llama.cpp, one at a time"] = "--single-requests 0"
    try:
        values = interleave(contenders, args.rounds)
    finally:
        for server in servers:
            server.close()
    baseline = ("(p) llama-cpp-python, one at a time" if peer is not None else
                "(o) llama.cpp, one at a time" if first else many_name)
    workload = summary(requests)
    return {"values": values, "skipped": skipped, "workload": workload, "baseline": baseline,
            "fp32_ceiling": fp32_ceiling(folder, workload, args.threads)}


def fp32_ceiling(folder: Path, workload: dict, threads: int) -> dict:
    """The most output tok/s that fp32 arithmetic allows on this workload on this machine: the
    workload's linear-layer FLOPs (prefill without the lm_head but for each prompt's last token,
    then the lm_head at every decode step) at the machine's best fp32 matmul rate (roofline's
    matmul_flops: MKL, oneDNN and the own GEMM on n = 2048, the same threads). Attention is left
    out, so the true ceiling is lower still. Kernels that dequantize into fp32 registers and
    accumulate in fp32, as the GGUF GEMM does, cannot beat it; only integer dot products on
    8-bit activations (llama.cpp's way) run more multiply-adds per cycle."""
    import torch
    from roofline import matmul_flops

    from services.worker.model_config import ModelArchConfig

    arch = ModelArchConfig.from_model(folder)  # a folder or a bare GGUF file
    lm_head = arch.vocab_size * arch.hidden_size
    params = linear_params(arch)
    prompts, outputs, n = workload["prompt_tokens"], workload["output_tokens"], workload["num_requests"]
    flops = 2 * (prompts * (params - lm_head) + n * lm_head + (outputs - n) * params)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak = matmul_flops(torch.float32)
    finally:
        torch.set_num_threads(previous)
    return {"workload_flops": flops, "fp32_matmul_flops_per_s": peak, "threads": threads,
            "max_output_tok_per_s": outputs * peak / flops}


def linear_params(arch) -> int:
    """Weights of the linear layers, the lm_head included (roofline.model_costs' count, from the arch)."""
    h, heads, kv = arch.hidden_size, arch.num_heads, arch.num_kv_heads
    per_layer = h * heads * arch.head_dim * 2 + h * kv * arch.head_dim * 2 + 3 * h * arch.intermediate_size
    return arch.num_layers * per_layer + arch.vocab_size * h


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds


def rows_for(result: dict) -> list[list]:
    values, base = result.get("values", {}), result.get("baseline")
    base_med = statistics.median(values[base]) if base in values else None
    rows = []
    for name, vals in values.items():
        med = statistics.median(vals)
        ratio = f"{med / base_med:.2f}x" if base_med else ""
        rows.append([name, f"{med:.1f}", ", ".join(f"{v:.1f}" for v in vals), ratio])
    for name, why in result.get("skipped", {}).items():
        rows.append([name, "skipped", why, ""])
    return rows


def report(results: dict, args, load_before: str) -> Path:
    parts = []
    headers = ["contender", "tok/s (median)", "each round", "vs baseline"]
    titles = {"decode": "Batch-1 decode from the model's GGUF (baseline: llama-bench)",
              "int8": "Batch-1 decode, int8 against bf16 weights (baseline: bf16)",
              "actquant": "int8 against fp32 activations on the GGUF (decode and prefill tok/s; ratios against "
                          "fp32 activations' decode: compare (i) with (a) within a phase)",
              "serve": "Concurrent ShareGPT requests (baseline: llama-cpp-python one at a time, else llama-server 1 slot; "
                     "with --single-requests 0 llama-server with 16 slots)"}
    for key, title in titles.items():
        if key in results:
            parts.append(f"### {title}\n\n" + markdown_table(headers, rows_for(results[key])))
            if key == "serve":
                parts.append(_ceiling_text(results[key]))
            if key == "actquant":
                r = results[key]["roofline"]
                parts.append(f"CPU kernel tier: {results[key]['tier']}. Roofline at batch 1: the linear weights "
                             f"are {r['weight_bytes'] / 1e6:.1f} MB as stored; at the measured bandwidth "
                             f"({r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, median of one probe per round) they "
                             f"bound decode at {r['bound_tok_per_s']:.0f} tok/s; int8 activations reach "
                             f"{100 * r['fraction_int8']:.0f}% of it.\n")
    if "int8" in results:
        lines = [f"- {c!r}: " + _compare_text(r) for c, r in zip(CHATS, results["int8"]["greedy_vs_fp32"])]
        parts.append("### int8 (fp32 activations) greedy tokens against fp32 weights\n\n" + "\n".join(lines))
    body = f"Threads: {args.threads}; rounds: {args.rounds} (contenders interleaved in each round); CPU kernel " \
        f"tier: {args.tier} (--cpu-isa {args.cpu_isa}).\n\n" + \
        "\n\n".join(parts) + "\n"
    return write_results(args.out, "Quantized weights against llama.cpp and bf16", load_before, body, results)


def _ceiling_text(serve: dict) -> str:
    c, values = serve["fp32_ceiling"], serve["values"]
    line = (f"fp32 ceiling: the workload's linear layers are {c['workload_flops'] / 1e9:.0f} GFLOP; at this "
            f"machine's best fp32 matmul, {c['fp32_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s ({c['threads']} threads), "
            f"no fp32 kernel can pass {c['max_output_tok_per_s']:.0f} output tok/s")
    if serve["baseline"] in values:
        base = statistics.median(values[serve["baseline"]])
        line += (f" = {c['max_output_tok_per_s'] / base:.1f}x the baseline; 10x the baseline would need "
                 f"{10 * base * c['workload_flops'] / serve['workload']['output_tokens'] / 1e9:.0f} GFLOP/s")
    return line + ".\n"


def _compare_text(r: dict) -> str:
    if r["equal"]:
        return f"token-equal ({r['compared']} tokens)"
    if "first_divergence" in r:
        gap = r.get("our_top2_logprob_gap")
        return f"first differs at token {r['first_divergence']} of {r['compared']}" + (
            f" (our top-2 logprob gap there: {gap:.3f})" if gap is not None else "")
    return f"equal over {r['compared']} tokens, then lengths {r['lengths']}"


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    folder = model_folder(args.model)
    sections = args.sections.split(",")
    bench_bin = llamacpp.binary(args.llama_cpp_dir, "llama-bench")
    server_bin = llamacpp.binary(args.llama_cpp_dir, "llama-server")
    tier = args.tier = select_tier(args.cpu_isa, args.libraries_isa)
    if args.kv_blocks:
        ENGINE_DEFAULTS["num_gpu_blocks"] = args.kv_blocks
    print(f"CPU kernel tier: {tier}", flush=True)
    results = {}
    for name in sections:
        print(f"== {name}", flush=True)
        if name == "decode":
            results[name] = section_decode(folder, args, bench_bin)
        elif name == "int8":
            results[name] = section_int8(folder, args)
        elif name == "actquant":
            results[name] = section_actquant(folder, args, bench_bin)
        elif name == "serve":
            results[name] = section_serve(folder, args, server_bin)
        else:
            raise SystemExit(f"unknown section {name!r}")
        print(results[name], flush=True)
    print(report(results, args, load_before).read_text())


if __name__ == "__main__":
    main()
