"""Roofline: this machine's matmul FLOP/s and memory bandwidth against what the engine's
prefill and decode steps reach at batch 1, 16 and 64.

    python bench/roofline.py                          # fp32 and bf16, context 128
    python bench/roofline.py --batch-sizes 1,16,64 --context 256 --decode-steps 8 --profile

Limits: the best of ten large square matmuls (fp32, bf16; MKL, oneDNN and the own GEMM) and
of large tensor copies (read + write bytes), sums and one-row GEMMs (read bytes), measured
before and after the engine runs, the higher kept (other load on the machine only lowers
them). Model cost from config.json: FLOPs per token = 2 x (linear weights,
lm_head included) + 4 x layers x heads x head_dim x context (QK^T and PV); bytes per decode
step = every linear weight once + the K/V each sequence reads (context x layers x 2 x KV heads
x head_dim in the cache dtype). Decode is timed by driving `llm.engine.step()` with B
requests of `--context` random prompt tokens in flight (after their prefill and one warm-up
step), in --rounds rounds; prefill is one step over B prompts of `--context` tokens. Compute
fraction = achieved FLOP/s / matmul peak; bandwidth fraction = (bytes / bandwidth) / step time,
i.e. how close the step is to the time it would take just to stream its bytes. This machine's
bandwidth drifts by up to 2x within minutes (a KVM guest sharing its host), so each round
of decode steps comes right after its own bandwidth probe and the fraction is the median over
the rounds of each round's pair; the fraction against the run's best bandwidth is kept too.
Writes bench/results/roofline.{md,json}; --profile adds the time per step in the one-call decoder
stack, the linear layers and each kernel (wall time around each call; once as the step runs, once
layer by layer to show the kernels) and torch.profiler's top ops of one decode step.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import add_cpu_isa, engine_tier_args, loadavg, markdown_table, select_tier, show_results  # noqa: E402
from kernels.linear import GemmWeight, invariant_linear, prepack  # noqa: E402
from runners import DTYPES  # noqa: E402
from workload import model_folder  # noqa: E402


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """The best of MKL (torch.mm), oneDNN with a packed weight and the project's own GEMM (what the
    engine's linear layers use where the CPU runs it): the machine's limit is what its fastest
    GEMM reaches."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    weights = [prepack(b.t().contiguous(), library) for library in ("onednn", "gemm")]
    contenders = [lambda: torch.mm(a, b), *(lambda w=w: invariant_linear(a, w, None) for w in weights)]
    for fn in contenders:
        fn()
    best = min(_timed(fn) for _ in range(repeats) for fn in contenders)
    return 2 * n ** 3 / best


def bandwidth(num_bytes: int = 256 << 20, repeats: int = 10) -> float:
    """The best of a large copy (read + write bytes), a large sum (read bytes) and, where it runs,
    the own GEMM on one row (it reads a weight of num_bytes once): decode mostly reads weights,
    and the floor must not be slower than a kernel the engine already has."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    read = min(_timed(lambda: src.sum()) for _ in range(repeats))
    best = max(2 * num_bytes / copy, num_bytes / read)
    del dst
    weight = prepack(src.view(-1, 4096), "gemm")
    if isinstance(weight, GemmWeight):
        row = torch.ones(1, 4096)
        invariant_linear(row, weight, None)
        best = max(best, num_bytes / min(_timed(lambda: invariant_linear(row, weight, None)) for _ in range(repeats)))
    return best


def measure_limits(dtypes: list[str]) -> dict:
    limits = {"bandwidth_bytes_per_s": bandwidth()}
    for dtype in dtypes:
        limits[f"matmul_flops_{dtype}"] = matmul_flops(DTYPES[dtype])
    return limits


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_costs(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter
    linear_params = layers * per_layer + cfg["vocab_size"] * h
    return {"linear_params": linear_params, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim}


def flops_per_token(costs: dict, context: int) -> float:
    return 2 * costs["linear_params"] + 4 * costs["layers"] * costs["heads"] * costs["head_dim"] * context


def decode_bytes(costs: dict, batch: int, context: int, elem: int, weight_bytes: float | None = None) -> float:
    """Weights once (their stored bytes where known: quantized ones are smaller) + the K/V read."""
    kv = batch * context * costs["layers"] * 2 * costs["kv_heads"] * costs["head_dim"] * elem
    return (weight_bytes if weight_bytes is not None else costs["linear_params"] * elem) + kv


def linear_weight_bytes(model) -> int:
    """Bytes a decode step streams for the linear layers (lm_head included), as stored."""
    from kernels.quant import QuantParts, QuantWeight
    seen, total = set(), 0
    for module in model.modules():
        for name in getattr(module, "linear_weights", ()):
            weight = getattr(module, name)
            quantized = isinstance(weight, (QuantWeight, QuantParts))  # QuantParts: a mix's fused q/k/v, gate/up
            tensor = weight.data if quantized else getattr(weight, "packed", weight)
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


EXTRA_STEPS = 24  # beyond the timed ones: prefill, warm-up, the profiled step and both breakdowns (11)


def _add_requests(llm, batch: int, context: int, steps: int, seed: int) -> None:
    """Requests that run for the whole measurement (the KV cache is sized to hold them)."""
    from pagedserve import SamplingParams
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(16, 49000) for _ in range(context)]
        params = SamplingParams(temperature=0, max_tokens=steps + EXTRA_STEPS, ignore_eos=True)
        llm.scheduler.add_request(f"r{seed}-{i}", prompt, params)


def time_engine(folder: Path, dtype: str, batch: int, context: int, steps: int, profile: bool, rounds: int,
                quantization: str = "none") -> dict:
    """Prefill seconds for batch x context tokens, mean decode step seconds, each round's
    (bandwidth, decode step seconds) pair, the linear weights' bytes and the profile tables
    (None without --profile)."""
    from pagedserve import LLM
    llm = LLM(str(folder), dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * context),
              **engine_tier_args(),
              num_gpu_blocks=batch * (context + steps + EXTRA_STEPS) // 16 + batch + 16, enable_prefix_caching=False,
              quantization=quantization)
    _add_requests(llm, batch, context, steps, seed=batch)
    start = time.perf_counter()
    llm.engine.step()  # the whole prefill (and each sequence's first token)
    prefill = time.perf_counter() - start
    llm.engine.step()  # warm-up decode
    per_round = max(1, steps // rounds)
    paired = []
    for _ in range(rounds):
        probe = bandwidth(repeats=5)
        start = time.perf_counter()
        for _ in range(per_round):
            llm.engine.step()
        paired.append({"bandwidth_bytes_per_s": probe, "decode_step_s": (time.perf_counter() - start) / per_round})
    decode = sum(p["decode_step_s"] for p in paired) / len(paired)
    table = _profile(llm) if profile else None
    breakdown = _breakdowns(llm, steps=5) if profile else None
    weight_bytes = linear_weight_bytes(llm.engine.workers["worker-0"].runner.model)
    return {"prefill_s": prefill, "decode_step_s": decode, "paired": paired, "profile": table,
            "breakdown": breakdown, "weight_bytes": weight_bytes}


OPS_FIELDS = ("paged_attention", "write_kv", "rms_norm", "apply_rotary", "silu_and_mul")


def _breakdowns(llm, steps: int) -> dict:
    """The step as it runs (the one-call decoder stack where there is one), then layer by layer,
    which shows each kernel (the stack's calls are invisible from Python)."""
    model = next(iter(llm.engine.workers.values())).runner.model
    result = {"": _breakdown(llm, steps)}
    if model.stack is not None:
        stack, model.stack = model.stack, None
        try:
            result[", layer by layer"] = _breakdown(llm, steps)
        finally:
            model.stack = stack
    return result


class _TimedStack:
    def __init__(self, stack, totals: dict):
        self.stack, self.totals = stack, totals

    def runs(self, *args) -> bool:
        return self.stack.runs(*args)

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.stack(*args)
        finally:
            self.totals["decoder_stack"] += time.perf_counter() - start


def _breakdown(llm, steps: int) -> dict:
    """ms per decode step spent in the one-call decoder stack, the linear layers outside it (the
    lm_head when the stack runs) and each kernel of the model's Ops called from Python (wall
    time around each call: torch.profiler does not see inside the compiled CPU kernels)."""
    model = next(iter(llm.engine.workers.values())).runner.model
    totals = dict.fromkeys(("decoder_stack", "linear", *OPS_FIELDS), 0.0)
    stack = model.stack
    if stack is not None:
        model.stack = _TimedStack(stack, totals)

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
        return call

    ops, linear_modules = model.ops, [m for m in model.modules() if hasattr(m, "linear")]
    saved_ops, saved_linear = {f: getattr(ops, f) for f in OPS_FIELDS}, [m.linear for m in linear_modules]
    for field in OPS_FIELDS:  # the Ops bundle is frozen and shared: patched for these steps only
        object.__setattr__(ops, field, timed(field, saved_ops[field]))
    for module, fn in zip(linear_modules, saved_linear):
        module.linear = timed("linear", fn)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        step = time.perf_counter() - start
    finally:
        for field, fn in saved_ops.items():
            object.__setattr__(ops, field, fn)
        for module, fn in zip(linear_modules, saved_linear):
            module.linear = fn
        model.stack = stack
    result = {name: 1e3 * t / steps for name, t in totals.items()}
    result["other"] = 1e3 * step / steps - sum(result.values())
    result["step"] = 1e3 * step / steps
    return result


def _profile(llm) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def analyse(costs: dict, limits: dict, dtype: str, batch: int, context: int, timing: dict,
            quantization: str = "none") -> dict:
    elem = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    weights = timing.get("weight_bytes")
    peak, bw = limits[f"matmul_flops_{dtype}"], limits["bandwidth_bytes_per_s"]
    prefill_flops = batch * context * flops_per_token(costs, context // 2)  # mean context over the prompt
    step = timing["decode_step_s"]
    decode_flops = batch * flops_per_token(costs, context)
    fractions = [decode_bytes(costs, batch, context, elem, weights) / p["bandwidth_bytes_per_s"] / p["decode_step_s"]
                 for p in timing["paired"]]
    return {
        "dtype": dtype if quantization == "none" else f"{dtype} {quantization}", "batch": batch, "context": context,
        "weight_bytes": weights,
        "prefill_tok_s": batch * context / timing["prefill_s"],
        "prefill_compute_frac": prefill_flops / timing["prefill_s"] / peak,
        "decode_step_ms": step * 1e3, "decode_tok_s": batch / step,
        "decode_compute_frac": decode_flops / step / peak,
        "decode_bandwidth_frac": statistics.median(fractions),
        "decode_bandwidth_frac_range": (min(fractions), max(fractions)),
        "paired_bandwidth_bytes_per_s": statistics.median(p["bandwidth_bytes_per_s"] for p in timing["paired"]),
        "decode_bandwidth_frac_best_bw": decode_bytes(costs, batch, context, elem, weights) / bw / step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantizations", default="none",
                        help="weights per dtype: none, gguf (the folder's GGUF), int8; bytes per step are the stored ones")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--decode-steps", type=int, default=12, help="timed decode steps per batch size")
    parser.add_argument("--rounds", type=int, default=3,
                        help="the decode steps come in this many rounds, each after its own bandwidth probe")
    parser.add_argument("--profile", action="store_true", help="torch.profiler of one decode step at each point")
    parser.add_argument("--out", default="roofline")
    add_cpu_isa(parser)
    args = parser.parse_args()
    select_tier(args.cpu_isa, args.libraries_isa)
    load_before = loadavg()
    folder = model_folder(args.model)
    costs = model_costs(folder)
    limits = measure_limits(args.dtypes.split(","))
    print(json.dumps(limits), flush=True)
    timings = {}
    for dtype in args.dtypes.split(","):
        for quantization in args.quantizations.split(","):
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                key = (dtype, quantization, batch)
                timings[key] = time_engine(folder, dtype, batch, args.context, args.decode_steps, args.profile,
                                           args.rounds, quantization)
                print(*key, {k: v for k, v in timings[key].items() if k != "profile"}, flush=True)
    again = measure_limits(args.dtypes.split(","))  # limits are the best seen: other load only lowers them
    limits = {k: max(v, again[k]) for k, v in limits.items()}
    paired_best = max(p["bandwidth_bytes_per_s"] for t in timings.values() for p in t["paired"])
    limits["bandwidth_bytes_per_s"] = max(limits["bandwidth_bytes_per_s"], paired_best)
    rows = [analyse(costs, limits, dtype, batch, args.context, t, q) for (dtype, q, batch), t in timings.items()]
    profiles = {f"{d} {q} batch {b}": t["profile"] for (d, q, b), t in timings.items() if t["profile"]}
    breakdowns = {f"{d} {q} batch {b}{mode}": breakdown for (d, q, b), t in timings.items() if t["breakdown"]
                  for mode, breakdown in t["breakdown"].items()}
    body = _body(costs, limits, rows, profiles, breakdowns, args)
    show_results(args.out, "Roofline: prefill and decode against this machine's limits", load_before,
                 body, {"costs": costs, "limits": limits, "rows": rows, "profiles": profiles,
                        "breakdowns": breakdowns})


def _body(costs: dict, limits: dict, rows: list[dict], profiles: dict, breakdowns: dict, args) -> str:
    lines = [f"Model: {costs['linear_params'] / 1e6:.1f} M linear weights (lm_head included), "
             f"{flops_per_token(costs, args.context) / 1e6:.0f} MFLOP per token at context {args.context}.",
             "Limits: " + ", ".join(f"{k} {v / 1e9:.1f} G" for k, v in limits.items()), ""]
    headers = ["dtype", "batch", "prefill tok/s", "prefill % compute", "decode ms/step", "decode tok/s",
               "decode % compute", "decode % bandwidth floor (paired)", "paired probe GB/s",
               "% floor at the run's best GB/s"]
    table = [[r["dtype"], r["batch"], r["prefill_tok_s"], f"{100 * r['prefill_compute_frac']:.1f}%",
              r["decode_step_ms"], r["decode_tok_s"], f"{100 * r['decode_compute_frac']:.1f}%",
              "{:.1f}% ({:.0f}-{:.0f})".format(100 * r["decode_bandwidth_frac"],
                                                *(100 * f for f in r["decode_bandwidth_frac_range"])),
              f"{r['paired_bandwidth_bytes_per_s'] / 1e9:.1f}", f"{100 * r['decode_bandwidth_frac_best_bw']:.1f}%"]
             for r in rows]
    lines.append(markdown_table(headers, table))
    if breakdowns:
        names = ["step", "decoder_stack", "linear", *OPS_FIELDS, "other"]
        lines += ["\n## Where a decode step goes (ms per step, wall time around each call, 5 steps)\n",
                  markdown_table(["point", *names], [[point, *(f"{b[n]:.1f}" for n in names)]
                                                     for point, b in breakdowns.items()])]
    for name, table_text in profiles.items():
        lines += [f"\n## torch.profiler, one decode step, {name}\n", "```", table_text, "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
