"""Gemma 3 1B shape in bf16: the engine against llama.cpp on the model's BF16 GGUF and against vLLM CPU,
batch-1 decode and concurrent ShareGPT requests, contenders interleaved round by round, same threads.

    python -m services.tools.make_model --arch gemma3 --size 1b --dtype bfloat16 --hidden-size 1152 \\
        --num-layers 26 --num-heads 4 --num-kv-heads 1 --head-dim 256 --intermediate-size 6912 \\
        --vocab-size 262144 --max-position-embeddings 32768 --rope-theta 1000000 --tie-word-embeddings --out M
    python bench/gemma3_1b_speed.py --model M --real-shape          # config.json as Gemma 3 1B's (below)
    python convert_hf_to_gguf.py M --outtype bf16 --outfile M.bf16.gguf   # llama.cpp's converter
    python bench/gemma3_1b_speed.py --model M --gguf M.bf16.gguf --llama-cpp-dir LLAMA_CPP/build/bin

make_model's gemma3 config tests both layer kinds on short prompts (every second layer global, a window
of 64, a soft-cap); --real-shape rewrites M/config.json to Gemma 3 1B's (window 512, every 6th layer
global, the attention scale head_dim ** -0.5, no final soft-cap) and exits: run it before converting.
The weights are random (make_model's tokenizer, whose vocabulary llama.cpp's converter does not know:
name its pre-tokenizer "gpt-2" as bench/README.md says for random vocabularies).

Sections (--sections, both by default):
  decode  batch-1 decode tok/s: (a) the engine on M's bf16 safetensors (--quantization none, bf16),
          timed on engine.step() after the prefill (bench/quant.py's decode_rate); (l) llama-bench tg
          on the BF16 GGUF (from an empty context); (v) vLLM on M's safetensors in bf16, one request of
          16 prompt tokens and --decode-steps output tokens in one LLM.generate call (its 16-token
          prefill inside the time)
  serve   --num-requests (16) ShareGPT requests all at once, greedy, EOS ignored, output tok/s: (a) the
          engine's generate, (s) llama-server with that many slots on the BF16 GGUF, (v) vLLM's
          LLM.generate (bench/vllm_peer.py in its own venv: tcmalloc and its libiomp5 preloaded,
          VLLM_CPU_KVCACHE_SPACE=2, its OpenMP bound to the first --threads CPUs, as bench/runners.py
          VllmPeer starts it; KMP_BLOCKTIME=0 so that its idle threads do not spin while the others run)
vLLM is skipped with the reason when its venv is absent or the model does not load in it (the reason
from its log goes to the results). One warm-up pass of each contender, untimed. Writes
bench/results/gemma3_1b_speed.{md,json} (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
import runners  # noqa: E402
from common import add_cpu_isa, loadavg, markdown_table, select_tier, show_results  # noqa: E402
from quant import _rate, decode_rate, engine, interleave  # noqa: E402
from workload import Request, add_workload_flags, load_workload, summary  # noqa: E402

# Gemma 3 1B's config.json where it differs from make_model's gemma3 (the shapes are flags of make_model)
REAL_1B = {"sliding_window": 512, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
           "_sliding_window_pattern": 6}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.set_defaults(num_requests=16, max_output_len=32)
    parser.add_argument("--gguf", default=None, help="M's BF16 GGUF (llama.cpp's converter, --outtype bf16)")
    parser.add_argument("--real-shape", action="store_true", help="rewrite --model's config.json to Gemma 3 "
                        "1B's window, layer kinds, attention scale and soft-cap, then exit")
    parser.add_argument("--sections", default="decode,serve")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-bench and llama-server "
                        "(default: $LLAMA_CPP_DIR)")
    parser.add_argument("--vllm-venv", default=None, help="vLLM's venv (bench/install_vllm.sh; default: "
                        "$PAGEDSERVE_VLLM_VENV or ~/.cache/pagedserve/vllm-venv)")
    parser.add_argument("--out", default="gemma3_1b_speed", help="results file stem under bench/results/")
    add_cpu_isa(parser)
    return parser.parse_args()


def real_shape(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(REAL_1B, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                        for i in range(layers)])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def vllm_peer(args, folder: Path, requests: list[Request]):
    """(VllmPeer, None) or (None, why vLLM does not run this model here)."""
    venv = runners.vllm_venv(args.vllm_venv)
    if why := runners.vllm_missing(venv):
        return None, why
    before = os.environ.get("KMP_BLOCKTIME")
    os.environ["KMP_BLOCKTIME"] = "0"  # the peer's environment (VllmPeer copies ours); not read by this process
    try:
        peer = runners.VllmPeer(venv, str(folder), "bfloat16", requests, args.threads,
                                max_num_seqs=max(16, len(requests)), max_num_batched_tokens=2048)
    except RuntimeError as error:  # it exited: the last error line of its log says why
        lines = [line for line in str(error).splitlines() if "Error" in line or "error" in line]
        return None, "vLLM did not load the model: " + (lines[-1].strip() if lines else str(error)[-500:])
    finally:
        if before is None:
            os.environ.pop("KMP_BLOCKTIME")
        else:
            os.environ["KMP_BLOCKTIME"] = before
    peer.run()  # warm-up
    return peer, None


def timed(name: str, fn):
    """fn, its value printed as it comes (a run cut short still shows what it measured)."""
    def run() -> float:
        value = fn()
        print(f"{name}: {value:.2f}", flush=True)
        return value
    return run


def section_decode(args, folder: Path, gguf: Path | None, llm) -> dict:
    import random
    contenders, skipped, info = {}, {}, {}
    decode_rate(llm, 4, "warm")
    contenders["(a) engine, bf16 safetensors"] = lambda: decode_rate(llm, args.decode_steps, "decode")
    bench, why = llamacpp.binary(args.llama_cpp_dir, "llama-bench")
    if bench is None or gguf is None:
        skipped["(l) llama-bench tg, BF16 GGUF"] = why or "--gguf not given"
    else:
        contenders["(l) llama-bench tg, BF16 GGUF"] = lambda: llamacpp.bench_decode(
            bench, gguf, args.threads, args.decode_steps)
    rng = random.Random(0)
    one = [Request(prompt_ids=tuple(rng.randrange(16, 30000) for _ in range(16)), output_len=args.decode_steps)]
    peer, why = vllm_peer(args, folder, one)
    if peer is None:
        skipped["(v) vLLM, bf16 safetensors, one request"] = why
    else:
        info = peer.info
        contenders["(v) vLLM, bf16 safetensors, one request"] = lambda: _rate(*peer.run())
    try:
        values = interleave({name: timed(name, fn) for name, fn in contenders.items()}, args.rounds)
    finally:
        if peer is not None:
            peer.close()
    return {"values": values, "skipped": skipped, "vllm": info, "unit": "tok/s"}


def section_serve(args, folder: Path, gguf: Path | None, llm) -> dict:
    from pagedserve import SamplingParams
    requests = load_workload(args)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]

    def ours() -> float:
        start = time.perf_counter()
        outs = llm.generate([list(r.prompt_ids) for r in requests], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    ours()  # warm-up
    n = len(requests)
    contenders = {f"(a) engine, bf16 safetensors, {n} at once": ours}
    skipped, info, server = {}, {}, None
    path, why = llamacpp.binary(args.llama_cpp_dir, "llama-server")
    if path is None or gguf is None:
        skipped[f"(s) llama-server, {n} slots, BF16 GGUF"] = why or "--gguf not given"
    else:
        server = llamacpp.Server(path, gguf, args.threads, slots=n)
        server.run(requests[:2], concurrent=True)  # warm-up
        contenders[f"(s) llama-server, {n} slots, BF16 GGUF"] = lambda: _rate(*server.run(requests, concurrent=True))
    peer, why = vllm_peer(args, folder, requests)
    if peer is None:
        skipped[f"(v) vLLM, bf16 safetensors, {n} at once"] = why
    else:
        info = peer.info
        contenders[f"(v) vLLM, bf16 safetensors, {n} at once"] = lambda: _rate(*peer.run())
    try:
        values = interleave({name: timed(name, fn) for name, fn in contenders.items()}, args.rounds)
    finally:
        for closing in (server, peer):
            if closing is not None:
                closing.close()
    return {"values": values, "skipped": skipped, "vllm": info, "workload": summary(requests), "unit": "tok/s"}


def report(results: dict, args, load_before: str) -> Path:
    titles = {"decode": "Batch-1 decode", "serve": f"{args.num_requests} concurrent ShareGPT requests"}
    body = [f"Random-weight Gemma 3 1B shape (hidden 1152, 26 layers, 4 heads / 1 KV head, head_dim 256, "
            f"MLP 6912, vocabulary 262144, window 512 with every 6th layer global), bf16, {args.threads} "
            f"threads each, {args.rounds} round(s) interleaved (one pass of each contender in turn). The host "
            "is shared with other developers' jobs: see the load averages above and in the JSON (before and "
            "after); figures from a loaded 2-core host are indicative only.\n"]
    for section, result in results.items():
        base = "(a)"
        engine_value = next(statistics.median(v) for k, v in result["values"].items() if k.startswith(base))
        rows = [[name, f"{statistics.median(v):.2f}", ", ".join(f"{x:.2f}" for x in v),
                 f"{engine_value / statistics.median(v):.2f}x" if not name.startswith(base) else ""]
                for name, v in result["values"].items()]
        rows += [[name, "skipped", why, ""] for name, why in result["skipped"].items()]
        body.append(f"## {titles[section]}\n")
        if "workload" in result:
            body.append(f"Workload: {json.dumps(result['workload'])}\n")
        if result.get("vllm"):
            body.append(f"vLLM: {json.dumps(result['vllm'])}\n")
        body.append(markdown_table(["contender", "median tok/s", "rounds", "engine vs it"], rows) + "\n")
    return show_results(args.out, "Gemma 3 1B shape, bf16: engine vs llama.cpp vs vLLM CPU", load_before,
                        "\n".join(body), {"args": vars(args), "results": results})


def main() -> None:
    args = parse_args()
    if args.real_shape:
        real_shape(Path(args.model))
        return
    select_tier(args.cpu_isa, args.libraries_isa)
    load_before = loadavg()
    folder = Path(args.model)
    gguf = Path(args.gguf) if args.gguf else None
    llm = engine(folder, quantization="none", dtype="bfloat16", num_threads=args.threads,
                 max_num_seqs=max(16, args.num_requests))
    sections = {"decode": section_decode, "serve": section_serve}
    results = {}
    for name in args.sections.split(","):  # the results file rewritten after each section
        results[name] = sections[name](args, folder, gguf, llm)
        report(results, args, load_before)


if __name__ == "__main__":
    main()
