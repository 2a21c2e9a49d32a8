"""Quality of int8 activations (--activation-quant): each mode against fp32 dense weights on ShareGPT.

    python bench/activation_quality.py                       # 64 prompts x 64 tokens, default model

The reference is the default model's safetensors in fp32 (quantization none). Per mode (the Q4_1
GGUF with fp32 activations, and with int8 activations; int8 weights made at load, both ways):
  - free-running greedy agreement: each mode generates --tokens greedy tokens per prompt (the engine,
    batched); prompts whose tokens all equal fp32's, and the mean length of the common prefix;
  - teacher-forced: the fp32 model's greedy continuation is fed to every mode; at each of its
    positions the mode's next-token distribution against fp32's: mean KL(fp32 || mode) in nats, and
    the share of positions whose argmax equals fp32's.
llama.cpp's (llama-server's logprobs on the same file) is a later quiet-machine run: not here.
Writes bench/results/activation_quality.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import loadavg, markdown_table, write_results  # noqa: E402
from workload import model_folder, sharegpt_requests  # noqa: E402

MODES = {  # name: (quantization, activation_quant)
    "GGUF Q4_1, fp32 activations": ("gguf", "none"),
    "GGUF Q4_1, int8 activations": ("gguf", "int8"),
    "int8 weights, fp32 activations": ("int8", "none"),
    "int8 weights, int8 activations": ("int8", "int8"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharegpt-path", default=None)
    parser.add_argument("--out", default="activation_quality")
    return parser.parse_args()


def full_logits(model, tokens: list[int]):
    """fp32 logits [len(tokens), vocab] of one sequence through the model (a fresh KV cache)."""
    import torch

    from services.worker.models.llama import AttentionMetadata
    num, cfg, block = len(tokens), model.cfg, 16
    blocks = -(-num // block)
    caches = [(torch.zeros(blocks, block, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(blocks, block, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(positions=torch.arange(num), slot_mapping=torch.arange(num),
                             block_tables=torch.arange(blocks)[None], seq_lens=torch.tensor([num]),
                             query_start_loc=torch.tensor([0, num]))
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), caches, meta)
        return model.compute_logits(hidden).float()


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    import torch

    from kernels.linear import invariant_linear
    from kernels.ops import get_ops
    from pagedserve import LLM, SamplingParams
    from services.worker.loader import load_model
    torch.set_num_threads(args.threads)
    folder = model_folder(args.model)
    prompts = [r.prompt_ids for r in sharegpt_requests(args.prompts, folder, args.seed, args.max_prompt_len,
                                                       args.tokens, args.sharegpt_path)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def generate(**kw) -> list[list[int]]:
        llm = LLM(str(folder), seed=0, dtype="float32", num_threads=args.threads, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts), use_tqdm=False)]

    reference = generate(quantization="none")
    ops = get_ops("cpu", "cpu")
    dense = load_model(folder, torch.float32, torch.device("cpu"), ops, invariant_linear, "none")
    want = [torch.log_softmax(full_logits(dense, p + r)[len(p) - 1:-1], -1) for p, r in zip(prompts, reference)]
    del dense
    results = {}
    for name, (quantization, activation_quant) in MODES.items():
        print(f"== {name}", flush=True)
        tokens = generate(quantization=quantization, activation_quant=activation_quant)
        prefixes = []
        for got, ref in zip(tokens, reference):
            same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            prefixes.append(same)
        model = load_model(folder, torch.float32, torch.device("cpu"), ops, invariant_linear, quantization,
                           activation_quant=activation_quant)
        kls, agree = [], []
        for p, r, ref_logp in zip(prompts, reference, want):
            logp = torch.log_softmax(full_logits(model, p + r)[len(p) - 1:-1], -1)
            kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item())
            agree.append((logp.argmax(-1) == ref_logp.argmax(-1)).float().mean().item())
        results[name] = {"prompts_token_equal": sum(p == args.tokens for p in prefixes),
                         "mean_common_prefix": statistics.mean(prefixes),
                         "teacher_forced_argmax_agreement": statistics.mean(agree),
                         "mean_kl_nats": statistics.mean(kls)}
        print(results[name], flush=True)
        del model
    rows = [[name, f"{r['prompts_token_equal']} / {args.prompts}", f"{r['mean_common_prefix']:.1f}",
             f"{100 * r['teacher_forced_argmax_agreement']:.2f}%", f"{r['mean_kl_nats']:.5f}"]
            for name, r in results.items()]
    body = (f"{args.prompts} ShareGPT prompts (<= {args.max_prompt_len} tokens, seed {args.seed}) x {args.tokens} "
            f"greedy tokens, {args.threads} threads; reference: fp32 dense weights (safetensors).\n\n"
            + markdown_table(["mode", "prompts token-equal (free-running)", f"mean common prefix (of {args.tokens})",
                              "teacher-forced argmax agreement", "mean KL(fp32 || mode), nats"], rows))
    print(write_results(args.out, "int8 activations: quality against fp32 weights", load_before, body,
                        {"modes": results}).read_text())


if __name__ == "__main__":
    main()
