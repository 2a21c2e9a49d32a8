"""Does torch.compile of the model's per-layer MLP help a CPU decode step? (issue 5's CPU option)

    .venv/bin/python bench/compile_probe.py [--dtype bfloat16] [--batches 1,16] [--steps 10]

Times the engine's decode step (context 128) eagerly, then with every layer's MLP wrapped in
torch.compile(dynamic=True), and checks whether the compiled step gives the same token ids.
Writes bench/results/compile_probe.{md,json}.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import loadavg, markdown_table, show_results  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from services.tools.default_model import default_model_path  # noqa: E402


def decode_step_ms(llm: LLM, batch: int, steps: int) -> tuple[float, list[list[int]]]:
    """Median decode step with `batch` requests in flight; also the tokens they produced."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    requests = [llm.scheduler.add_request(f"probe-{batch}-{i}-{time.monotonic()}", [100 + i] * 128, params)
                for i in range(batch)]
    for _ in range(4):  # prefill (and compilation, the first time) out of the timing
        llm.engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    tokens = [list(r.seqs[0].output_token_ids) for r in requests]
    for request in requests:
        llm.scheduler.abort(request.request_id)
    llm.engine.step()
    return sorted(times)[len(times) // 2] * 1e3, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    load_before = loadavg()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(default_model_path()), dtype=args.dtype)
    eager = {b: decode_step_ms(llm, b, args.steps) for b in batches}
    start = time.perf_counter()
    for layer in llm.engine.workers["worker-0"].runner.model.layers:
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
    decode_step_ms(llm, 1, 1)  # compile
    compile_s = time.perf_counter() - start
    compiled = {b: decode_step_ms(llm, b, args.steps) for b in batches}
    rows = [[b, eager[b][0], compiled[b][0], f"{eager[b][0] / compiled[b][0]:.2f}x",
             "yes" if eager[b][1] == compiled[b][1] else "no"] for b in batches]
    body = (f"Model: SmolLM2-135M-Instruct, {args.dtype}, decode at context 128; compile took {compile_s:.0f} s.\n\n"
            + markdown_table(["batch", "eager ms/step", "compiled-MLP ms/step", "speed-up", "same tokens"], rows))
    show_results("compile_probe", "torch.compile of the MLP on a CPU decode step", load_before, body,
                 {"dtype": args.dtype, "compile_s": compile_s, "rows": rows})


if __name__ == "__main__":
    main()
