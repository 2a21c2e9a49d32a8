"""The cost of LoRA: 16 concurrent requests spread over 4 adapters against the same 16 on the base alone.

    python bench/lora.py [--size bench] [--ranks 8,64] [--num-requests 16] [--num-adapters 4] \\
        [--input-len 128] [--output-len 64] [--repeats 3] [--cpu-isa auto]

In one process (`LLM`, every request in one batch), on a make_model folder of --size (random weights; its
random adapters from services/tools/make_lora.py, every projection targeted). The contenders, interleaved
run by run so that a shared host's load falls on all of them alike:

- base:        the base model, a worker without --enable-lora (the one-call decoder stack);
- base+lora:   the same requests on a worker with --enable-lora, none naming an adapter (what serving
               adapters costs the base's requests: nothing, the same path);
- lora-rN:     the 16 requests round-robin over 4 rank-N adapters (the layers run one by one, each
               adapter's product per row through the batch-invariant linear layer).

Writes bench/results/lora.md and lora.json: output tokens per second (median of --repeats) and each
contender's ratio to base.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_cpu_isa, engine_tier_args, loadavg, markdown_table, select_tier, write_results  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", help="make_model size: tiny, small, bench (the figure), 1b")
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    add_cpu_isa(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    select_tier(args.cpu_isa, args.libraries_isa)
    from pagedserve import LLM, LoRARequest, SamplingParams
    from services.tools.make_lora import make_lora
    from services.tools.make_model import make_model
    from tests.conftest import random_prompts

    load_before = loadavg()
    ranks = [int(r) for r in args.ranks.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    folder = make_model(work / "model", arch="llama", size=args.size, seed=0, dtype=args.dtype)
    vocab = __import__("json").loads((folder / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_requests, vocab, args.input_len, args.input_len, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    common = dict(dtype=args.dtype, seed=0, max_num_seqs=max(args.num_requests, 16), **engine_tier_args())
    engines = {"base": LLM(str(folder), **common),
               "base+lora": LLM(str(folder), enable_lora=True, max_lora_rank=max(ranks),
                                max_cpu_loras=args.num_adapters * len(ranks), **common)}
    loras = {"base": None, "base+lora": None}
    for rank in ranks:
        adapters = [LoRARequest(f"r{rank}-{i}", 0, str(make_lora(work / f"r{rank}-{i}", folder, rank=rank,
                                                                   alpha=2 * rank, seed=rank * 100 + i)))
                    for i in range(args.num_adapters)]
        loras[f"lora-r{rank}"] = [adapters[i % len(adapters)] for i in range(args.num_requests)]
        engines[f"lora-r{rank}"] = engines["base+lora"]
    times: dict[str, list[float]] = {name: [] for name in loras}
    for name in loras:  # warm-up: kernels compiled, adapters loaded
        engines[name].generate(prompts[:2], params, use_tqdm=False,
                               lora_request=loras[name][:2] if loras[name] else None)
    for _ in range(args.repeats):
        for name, lora in loras.items():
            start = time.perf_counter()
            engines[name].generate(prompts, params, use_tqdm=False, lora_request=lora)
            times[name].append(time.perf_counter() - start)
    num_tokens = args.num_requests * args.output_len
    results = {name: {"seconds": statistics.median(t), "tokens_per_s": num_tokens / statistics.median(t)}
               for name, t in times.items()}
    base = results["base"]["tokens_per_s"]
    rows = [[name, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x", f"{r['seconds']:.2f}"]
            for name, r in results.items()]
    body = "\n".join([
        f"{args.num_requests} concurrent requests ({args.input_len} prompt + {args.output_len} output tokens), "
        f"llama {args.size} ({args.dtype}), {args.num_adapters} adapters a rank, median of {args.repeats}.", "",
        markdown_table(["contender", "output tok/s", "vs base", "seconds"], rows), ""])
    path = write_results("lora", "LoRA: 16 concurrent over 4 adapters vs the base alone", load_before, body,
                         {"args": vars(args), "results": results})
    print(path.read_text())


if __name__ == "__main__":
    main()
