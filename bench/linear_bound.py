"""What the linear layers alone cost per decode step: the floor that no engine change above
the matrix library can go below.

    python bench/linear_bound.py                    # fp32 and bf16, batch 1, 2, 16, 64
    python bench/linear_bound.py --dtypes bfloat16 --quantizations none,int8,q4_1,q8_0 --batch-sizes 1,16
    python bench/linear_bound.py --dtypes float32 --quantizations q4_1,q4_1:int8 --batch-sizes 1,16,128 \
        --threads 1 --cpu-time --out linear_bound_actquant     # int8 against fp32 activations, kernels only

One step's worth of the served model's linear layers (every layer's own weights, so they
stream from memory as in a real step; the lm_head last), timed for the engine's path
(kernels.linear.invariant_linear on weights packed for the own GEMM, kernels/csrc/gemm.c),
for its fallback (the same on oneDNN-packed weights, where the CPU lacks AVX-512) and for
MKL (F.linear on dense weights, what transformers runs), and with --quantizations for the same
weights quantized (kernels/quant.py on kernels/csrc/quant_gemm.c: int8 per output channel, GGUF
blocks made by the gguf package's quantizer). Reports ms per step, the weight bytes per second
that implies (each contender's own bytes), its multiply-add rate (GFLOP/s) and the tokens/s bound it
sets on decode: batch / step time, as if everything else (attention, norms, sampling, Python)
were free. Best of --repeats.
Writes bench/results/linear_bound.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import add_cpu_isa, loadavg, markdown_table, select_tier, show_results  # noqa: E402
from kernels import quant  # noqa: E402
from kernels.linear import GemmWeight, invariant_linear, prepack  # noqa: E402
from runners import DTYPES  # noqa: E402
from workload import model_folder  # noqa: E402


def step_shapes(folder: Path) -> list[tuple[int, int]]:
    """(out, in) of every linear weight one forward pass multiplies, in order."""
    cfg = json.loads((folder / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def quantized(weight: torch.Tensor, fmt: str, dtype: torch.dtype) -> quant.QuantWeight:
    """weight [N, K] as `fmt`: int8 per output channel (the loader's quantize_int8), or GGUF blocks
    by the gguf package's own quantizer."""
    if fmt == "int8":
        return quant.quantize_int8(weight, dtype)
    from gguf import GGMLQuantizationType, quants

    blocks = quants.quantize(weight.float().numpy(), GGMLQuantizationType[fmt.upper()])
    return quant.from_blocks(blocks, quant.FORMATS[fmt], weight.shape[1], dtype)


def _engine(x: torch.Tensor, weight) -> torch.Tensor:
    return invariant_linear(x, weight, None)  # a GemmWeight, a oneDNN-packed one or a QuantWeight


def time_step(weights: list[torch.Tensor], shapes, batch: int, dtype: torch.dtype, fn, repeats: int,
              clock=time.perf_counter) -> float:
    inputs = {k: torch.randn(batch, k).to(dtype) for k in {k for _, k in shapes}}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass builds oneDNN's kernels for these shapes
        start = clock()
        for weight, (_, k) in zip(weights, shapes):
            fn(inputs[k], weight)
        best = min(best, clock() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,2,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantizations", default="none",
                        help="none (the dense contenders) and/or int8, q4_0, q4_1, q8_0 (quant_gemm.c); "
                             "FMT:int8 for the same weights with int8 activations (quant_dot.c)")
    parser.add_argument("--out", default="linear_bound")
    parser.add_argument("--threads", type=int, default=None, help="torch's and the kernels' threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in this process's CPU seconds, not wall seconds (with --threads 1: the kernels' "
                             "own cost on a host that other processes load; the bandwidth they reach is shared)")
    add_cpu_isa(parser)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.cpu_isa = select_tier(args.cpu_isa, args.libraries_isa)
    load_before = loadavg()
    shapes = step_shapes(model_folder(args.model))
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    quantizations = args.quantizations.split(",")
    rows, data = [], []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        dense = [torch.randn(n, k).to(dtype) / k ** 0.5 for n, k in shapes]
        contenders = []  # (library, weights, fn, their bytes)
        if "none" in quantizations:
            gemm = [prepack(w, "gemm") for w in dense]
            onednn = [prepack(w, "onednn") for w in dense]  # dense where oneDNN cannot run the dtype here
            num_bytes = sum(w.numel() * w.element_size() for w in dense)
            if isinstance(gemm[0], GemmWeight):  # else this CPU has no compiled GEMM for the dtype
                contenders.append(("own GEMM (engine)", gemm, _engine, num_bytes))
            contenders += [("oneDNN packed (fallback)", onednn, _engine, num_bytes),
                           ("MKL F.linear (transformers)", dense, F.linear, num_bytes)]
        for name_q in (q for q in quantizations if q != "none"):
            fmt, _, activations = name_q.partition(":")  # q4_1:int8 -> int8 activations (quant_dot.c)
            weights = [quantized(w, fmt, dtype).with_activations(activations == "int8") for w in dense]
            library = f"quant_dot {fmt}, int8 activations" if activations == "int8" else f"quant_gemm {fmt}"
            contenders.append((library, weights, _engine, sum(w.data.numel() for w in weights)))
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            for library, weights, fn, num_bytes in contenders:
                seconds = time_step(weights, shapes, batch, dtype, fn, args.repeats,
                                    time.process_time if args.cpu_time else time.perf_counter)
                row = dict(dtype=name, batch=batch, library=library, ms=seconds * 1e3,
                           gb_per_s=num_bytes / seconds / 1e9, gflop_per_s=batch * flops_per_row / seconds / 1e9,
                           bound_tok_per_s=batch / seconds)
                data.append(row)
                rows.append([name, batch, library, f"{row['ms']:.1f}", f"{row['gb_per_s']:.1f}",
                             f"{row['gflop_per_s']:.1f}", f"{row['bound_tok_per_s']:.0f}"])
                print(row, flush=True)
        del dense, contenders
    clock = "process CPU seconds (--cpu-time)" if args.cpu_time else "wall seconds"
    body = (f"Timed in {clock}; threads {torch.get_num_threads()}; CPU kernel tier {args.cpu_isa}.\n\n"
            f"{len(shapes)} linear weights per step ({len(shapes) - 1} in the layers + lm_head).\n\n"
            + markdown_table(["dtype", "batch", "library", "ms / step", "weight GB/s", "GFLOP/s",
                              "decode tok/s bound"], rows))
    show_results(args.out, "Linear layers alone: the floor under a decode step", load_before, body,
                 {"rows": data})


if __name__ == "__main__":
    main()
