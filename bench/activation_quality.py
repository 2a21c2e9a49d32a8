"""Quality of int8 activations (--activation-quant) and of llama.cpp on the same GGUF: each against
fp32 dense weights on ShareGPT, and greedy parity of the engine with llama-server on the same file.

    python bench/activation_quality.py                                      # 64 prompts x 64 tokens, engine modes
    python bench/activation_quality.py --llama-cpp-dir LLAMA_CPP_BIN   # and llama.cpp, and parity

The reference is the default model's safetensors in fp32 (quantization none). Per mode (the Q4_1
GGUF with fp32 activations, and with int8 activations; int8 weights made at load, both ways; and
llama.cpp's llama-server on the same GGUF, as shipped: Q8_1 activations, f16 KV cache):
  - free-running greedy agreement: each mode generates --tokens greedy tokens per prompt (the engine,
    batched; EOS does not stop it and is not masked); prompts whose tokens all equal fp32's, and the
    mean length of the common prefix;
  - teacher-forced: the fp32 model's greedy continuation is fed to every mode; at each of its
    positions the mode's next-token distribution against fp32's: the share of positions whose argmax
    equals fp32's, and the mean KL(fp32 || mode) in nats. llama-server returns only its --top-k most
    likely tokens, so every mode also gets the KL over its own top-k plus one bucket for the rest of
    the vocabulary (a lower bound of the full KL; the engine's two figures show how close it is).
llama.cpp is driven one token per request (n_predict 1, n_probs --top-k, the slot's KV cache reused, so
each request evaluates one token, as a decode step): its greedy token is the top of its own softmax,
without the EOS mask its `ignore_eos` would add. --llama-variant adds a run with other llama-server
flags (e.g. "kv-f32=-ctk f32 -ctv f32") to tell what a divergence comes from.
Parity: the engine's greedy tokens (GGUF, each activation mode) against llama.cpp's, per prompt; at
the first divergence the top-2 logprob gap on each side, and the margin between the two tokens in
fp32 dense weights and in every other mode. A divergence is a near-tie when both sides' top-2 gaps are
under --near-tie nats. Writes bench/results/<--out>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
from common import loadavg, markdown_table, show_results  # noqa: E402
from workload import model_folder, sharegpt_requests  # noqa: E402

MODES = {  # --modes key: (label, quantization, activation_quant)
    "gguf-none": ("GGUF Q4_1, fp32 activations", "gguf", "none"),
    "gguf-int8": ("GGUF Q4_1, int8 activations", "gguf", "int8"),
    "int8-none": ("int8 weights, fp32 activations", "int8", "none"),
    "int8-int8": ("int8 weights, int8 activations", "int8", "int8"),
}
PARITY_MODES = ("gguf-none", "gguf-int8")  # the engine on llama.cpp's file


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharegpt-path", default=None)
    parser.add_argument("--modes", default=",".join(MODES), help=f"engine modes, comma-separated, of {list(MODES)}")
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-server (default: $LLAMA_CPP_DIR); "
                                                               "without it llama.cpp and parity are skipped")
    parser.add_argument("--llama-variant", action="append", default=[],
                        help="NAME=FLAGS: another llama-server run with these extra flags")
    parser.add_argument("--top-k", type=int, default=256, help="tokens per position llama-server returns")
    parser.add_argument("--near-tie", type=float, default=0.1, help="nats: a divergence whose top-2 gaps are "
                                                                     "both under this is a near-tie")
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


def common_prefix(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def bucket_kl(ref_logp, ids, logps):
    """Per position, KL(ref || mode) over the mode's top tokens (ids, logps: [positions, k]) and one
    bucket for the rest of the vocabulary: the KL of the two distributions coarsened to those classes,
    a lower bound of the full KL."""
    import torch
    ref_top = ref_logp.double().gather(1, ids)
    logps = logps.double()
    inside = (ref_top.exp() * (ref_top - logps)).sum(1)
    ref_rest = (1 - ref_top.exp().sum(1)).clamp(min=0)
    mode_rest = (1 - logps.exp().sum(1)).clamp(min=1e-30)
    rest = torch.where(ref_rest > 0, ref_rest * (ref_rest.clamp(min=1e-300) / mode_rest).log(), 0.0)
    return inside + rest


def quality(tokens: list[list[int]], reference: list[list[int]], ref_logps: list, tops: list, full_kls, args) -> dict:
    """The figures of one mode: free-running tokens against fp32's; teacher-forced tops (per prompt,
    (ids, logprobs) [positions, k] of the mode's most likely tokens, best first) against fp32's log-softmax."""
    prefixes = [common_prefix(got, ref) for got, ref in zip(tokens, reference)]
    agree = [(ids[:, 0] == ref.argmax(-1)).double().mean().item() for ref, (ids, _) in zip(ref_logps, tops)]
    kls = [bucket_kl(ref, ids, logps).mean().item() for ref, (ids, logps) in zip(ref_logps, tops)]
    out = {"prompts_token_equal": sum(p == args.tokens for p in prefixes), "mean_common_prefix": statistics.mean(prefixes),
           "teacher_forced_argmax_agreement": statistics.mean(agree), "mean_topk_kl_nats": statistics.mean(kls)}
    if full_kls is not None:
        out["mean_kl_nats"] = statistics.mean(full_kls)
    return out


def as_tensors(tops: list[list[tuple[int, float]]]):
    """[(id, logprob) * k] per position -> (ids, logprobs), each [positions, k]."""
    import torch
    return (torch.tensor([[t for t, _ in top] for top in tops]), torch.tensor([[v for _, v in top] for top in tops]))


def engine_mode(folder: Path, quantization: str, activation_quant: str, prompts, reference, ref_logps, args,
                params, peers: dict) -> tuple[dict, list, object]:
    """One engine mode: (figures, its greedy outputs with top-2 logprobs, its model for later probes).
    peers: {llama.cpp label: its teacher-forced tops}; the figures get, per peer, the teacher-forced
    KL(mode || peer) over the peer's top-k + rest and the share of positions whose argmax agree."""
    import torch

    from kernels.linear import invariant_linear
    from kernels.ops import get_ops
    from pagedserve import LLM
    from services.worker.loader import load_model
    llm = LLM(str(folder), seed=0, dtype="float32", num_threads=args.threads, quantization=quantization,
              activation_quant=activation_quant)
    outputs = [o.outputs[0] for o in llm.generate(prompts, [params] * len(prompts), use_tqdm=False)]
    del llm
    model = load_model(folder, torch.float32, torch.device("cpu"), get_ops("cpu", "cpu"), invariant_linear,
                       quantization, activation_quant=activation_quant)
    tops, full, against = [], [], {label: ([], []) for label in peers}
    for index, (p, r, ref_logp) in enumerate(zip(prompts, reference, ref_logps)):
        logp = torch.log_softmax(full_logits(model, p + r)[len(p) - 1:-1], -1)
        full.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item())
        values, ids = logp.topk(args.top_k, -1)
        tops.append((ids, values))
        for label, (kls, agree) in against.items():
            peer_ids, peer_logps = peers[label][index]
            kls.append(bucket_kl(logp, peer_ids, peer_logps).mean().item())
            agree.append((peer_ids[:, 0] == ids[:, 0]).double().mean().item())
    figures = quality([o.token_ids for o in outputs], reference, ref_logps, tops, full, args)
    figures["against_llama_cpp"] = {label: {"mean_topk_kl_nats": statistics.mean(kls),
                                            "argmax_agreement": statistics.mean(agree)}
                                    for label, (kls, agree) in against.items()}
    return figures, outputs, model


def llama_mode(server, prompts, reference, ref_logps, args) -> tuple[dict, list[list[int]], list]:
    """llama-server: (figures, free-running greedy tokens, its top-k at each of their steps,
    teacher-forced tops)."""
    tokens, free_tops, forced = [], [], []
    for p, r in zip(prompts, reference):
        got, steps = [], []
        for _ in range(args.tokens):
            top = server.next_token_top(p + got, args.top_k)
            steps.append(top)
            got.append(top[0][0])
        tokens.append(got)
        free_tops.append(steps)
        forced.append(as_tensors([server.next_token_top(p + r[:i], args.top_k) for i in range(len(r))]))
        print(f"   llama.cpp prompt {len(tokens)}/{len(prompts)}: common prefix {common_prefix(got, r)}", flush=True)
    return quality(tokens, reference, ref_logps, forced, None, args), tokens, free_tops, forced


def gap(top: list[tuple[int, float]]) -> float | None:
    return top[0][1] - top[1][1] if len(top) > 1 else None


def parity(name: str, ours, theirs: list[list[int]], their_tops: list, prompts, models: dict, args) -> dict:
    """The engine mode `name` against llama.cpp, per prompt: token-equal, or the first divergence with
    each side's top-2 gap there and the margin logp(ours) - logp(theirs) in every loaded model."""
    import torch
    per_prompt = []
    for index, (out, want, tops, prompt) in enumerate(zip(ours, theirs, their_tops, prompts)):
        got = out.token_ids
        at = common_prefix(got, want)
        if at == len(want):
            per_prompt.append({"prompt": index, "equal": True})
            continue
        a, b = got[at], want[at]
        margins = {}
        for model_name, model in models.items():
            logp = torch.log_softmax(full_logits(model, prompt + got[:at])[-1], -1)
            margins[model_name] = (logp[a] - logp[b]).item()
        their = dict(tops[at])
        per_prompt.append({"prompt": index, "equal": False, "first_divergence": at, "ours": a, "theirs": b,
                           "our_top2_gap": gap(out.logprobs[at].top), "their_top2_gap": gap(tops[at]),
                           "their_margin": their[b] - their[a] if a in their else None,
                           "margins_ours_minus_theirs": margins})
    for r in per_prompt:
        r["near_tie"] = r["equal"] or (r["our_top2_gap"] < args.near_tie and r["their_top2_gap"] < args.near_tie)
    return {"mode": name, "equal": sum(r["equal"] for r in per_prompt), "per_prompt": per_prompt}


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    import torch

    from kernels.linear import invariant_linear
    from kernels.ops import get_ops
    from pagedserve import LLM, SamplingParams
    from services.worker.gguf_weights import find_gguf_file
    from services.worker.loader import load_model
    torch.set_num_threads(args.threads)
    folder = model_folder(args.model)
    prompts = [r.prompt_ids for r in sharegpt_requests(args.prompts, folder, args.seed, args.max_prompt_len,
                                                       args.tokens, args.sharegpt_path)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=2)
    llm = LLM(str(folder), seed=0, dtype="float32", num_threads=args.threads, quantization="none")
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts), use_tqdm=False)]
    del llm
    dense = load_model(folder, torch.float32, torch.device("cpu"), get_ops("cpu", "cpu"), invariant_linear, "none")
    ref_logps = [torch.log_softmax(full_logits(dense, p + r)[len(p) - 1:-1], -1) for p, r in zip(prompts, reference)]
    results, peers, skipped = {}, {}, None
    server_bin, skipped = llamacpp.binary(args.llama_cpp_dir, "llama-server")
    for variant in ["llama.cpp (llama-server)=", *args.llama_variant] if server_bin else []:
        label, flags = variant.split("=", 1)
        label = label if label.startswith("llama.cpp") else f"llama.cpp, {label} ({flags})"
        print(f"== {label}", flush=True)
        with llamacpp.Server(server_bin, find_gguf_file(folder), args.threads, slots=1,
                             extra_args=tuple(flags.split())) as server:
            results[label], *peers[label] = llama_mode(server, prompts, reference, ref_logps, args)
        print(results[label], flush=True)
    outputs, models = {}, {"fp32 dense": dense}
    for key in args.modes.split(","):
        name, quantization, activation_quant = MODES[key]
        print(f"== {name}", flush=True)
        results[name], outputs[key], model = engine_mode(folder, quantization, activation_quant, prompts, reference,
                                                         ref_logps, args, params,
                                                         {label: forced for label, (_, _, forced) in peers.items()})
        if key in PARITY_MODES:
            models[name] = model
        print(results[name], flush=True)
    parities = {label: [parity(MODES[key][0], outputs[key], tokens, tops, prompts, models, args)
                        for key in PARITY_MODES if key in outputs] for label, (tokens, tops, _) in peers.items()}
    show_results(args.out, "int8 activations and llama.cpp: quality against fp32 weights, and parity",
                 load_before, report(results, parities, skipped, args),
                 {"modes": results, "parity": parities, "llama_cpp_skipped": skipped})


def report(results: dict, parities: dict, skipped: str | None, args) -> str:
    rows = [[name, f"{r['prompts_token_equal']} / {args.prompts}", f"{r['mean_common_prefix']:.1f}",
             f"{100 * r['teacher_forced_argmax_agreement']:.2f}%",
             f"{r['mean_kl_nats']:.5f}" if "mean_kl_nats" in r else "n/a (top-k only)", f"{max(r['mean_topk_kl_nats'], 0.0):.5f}"]  # -0.00000: rounding
            for name, r in results.items()]
    if skipped:
        rows.append(["llama.cpp (llama-server)", "skipped", skipped, "", "", ""])
    parts = [f"{args.prompts} ShareGPT prompts (<= {args.max_prompt_len} tokens, seed {args.seed}) x {args.tokens} "
             f"greedy tokens, {args.threads} threads; reference: fp32 dense weights (safetensors).\n",
             markdown_table(["mode", "prompts token-equal (free-running)", f"mean common prefix (of {args.tokens})",
                             "teacher-forced argmax agreement", "mean KL(fp32 || mode), nats",
                             f"mean KL over the mode's top-{args.top_k} + rest, nats"], rows)]
    against = [(name, r["against_llama_cpp"]) for name, r in results.items() if r.get("against_llama_cpp")]
    if against:
        labels = list(against[0][1])
        parts.append(f"### The engine against llama.cpp, teacher-forced (fp32's continuation)\n\n"
                     f"Per engine mode and llama-server run: mean KL(mode || llama.cpp) over llama.cpp's top-{args.top_k} "
                     "+ rest (nats), and the share of positions whose argmax agree.\n")
        parts.append(markdown_table(["mode", *labels], [
            [name, *(f"{a[label]['mean_topk_kl_nats']:.5f}, {100 * a[label]['argmax_agreement']:.2f}%" for label in labels)]
            for name, a in against]))
    for label, modes in parities.items():
        for p in modes:
            diverged = [r for r in p["per_prompt"] if not r["equal"]]
            parts.append(f"### Greedy parity: engine, {p['mode']} against {label}\n\n"
                         f"{p['equal']} / {args.prompts} prompts token-equal over {args.tokens} tokens; "
                         f"{sum(not r['near_tie'] for r in diverged)} of the {len(diverged)} first divergences are not "
                         f"near-ties (a side's top-2 gap >= {args.near_tie} nats). Margin: logp(our token) - "
                         "logp(llama.cpp's) at that position, in each model.\n")
            if diverged:
                parts.append(markdown_table(
                    ["prompt", "first divergence", "our top-2 gap", "llama.cpp top-2 gap", "near-tie",
                     *(f"margin, {m}" for m in diverged[0]["margins_ours_minus_theirs"])],
                    [[r["prompt"], r["first_divergence"], f"{r['our_top2_gap']:.3f}", f"{r['their_top2_gap']:.3f}",
                      "yes" if r["near_tie"] else "**no**",
                      *(f"{v:+.3f}" for v in r["margins_ours_minus_theirs"].values())] for r in diverged]))
    return "\n".join(parts)


if __name__ == "__main__":
    main()
