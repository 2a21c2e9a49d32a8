"""Quality per GGUF type: the engine on a GGUF file against transformers on the same file
dequantized to fp32, teacher-forced, with fp32 and with int8 activations; and against llama.cpp's
own logits on the same file. One command runs a list of files, any type.

    python bench/gguf_quality.py FILE_OR_FOLDER [...] --llama-cpp-dir /path/to/llama.cpp/build/bin
    python bench/gguf_quality.py default --prompts 4 --tokens 8          # the default model's Q4_1, engine only

Each argument is what --model takes (a GGUF file, a folder with config.json and one GGUF, or
"default"). Per file, --prompts ShareGPT prompts (the file's tokenizer, <= --max-prompt-len tokens):
  - reference: transformers (`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`, fp32: every
    tensor dequantized by the `gguf` package; with a folder's config.json where the model is a folder,
    as transformers maps no rope scaling from GGUF metadata) generates --tokens greedy tokens per prompt (EOS does
    not stop it); the log-softmax of its raw logits at each of those positions;
  - the engine (--quantization gguf, the file's blocks as they are; services.worker.loader.load_model,
    one prefill over prompt + continuation) per --activations mode (none: fp32 activations, target
    >= 99%; int8: 8-bit activations, target >= 97%): the share of positions whose argmax equals the
    reference's (teacher-forced next-token agreement), and the mean KL(reference || engine) in nats;
  - llama.cpp (llama-server on the same file, --llama-cpp-dir): its --top-k next tokens at each
    position of the same continuation, one token a request (bench/llamacpp.py's next_token_top): its
    own agreement with the reference and KL(reference || llama.cpp) over its top-k + one bucket for
    the rest (a lower bound of the full KL); per engine mode the KL(engine || llama.cpp) over
    llama.cpp's top-k + rest and the share of positions where the two argmaxes agree
    (bench/activation_quality.py's figures, there against fp32 dense weights). The last column puts every
    contender on llama.cpp's footing: KL(reference || contender) over the contender's own top-k + rest, so
    the engine's rows compare with llama.cpp's (the full KL is larger where the tail is flat, e.g. random
    weights). Each agreement comes with its count of positions and a 95% Wilson interval.
A type the engine does not serve yet gets its refusal in the table, not a crash. Writes
bench/results/<--out>.{md,json}.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402
from activation_quality import as_tensors, bucket_kl, full_logits  # noqa: E402
from common import add_cpu_isa, loadavg, markdown_table, select_tier, show_results, write_results  # noqa: E402
from gguf_files import gguf_path, mix_text, model_path, type_label  # noqa: E402
from workload import sharegpt_requests  # noqa: E402

TARGETS = {"none": 0.99, "int8": 0.97}  # teacher-forced agreement with the reference, issue 41
LABELS = {"none": "fp32 activations", "int8": "int8 activations"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="GGUF files or folders (what --model takes), or 'default'")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--activations", default="none,int8", help="engine modes: none, int8 or both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharegpt-path", default=None)
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-server (default: $LLAMA_CPP_DIR); "
                                                               "without it the llama.cpp columns are skipped")
    parser.add_argument("--top-k", type=int, default=256, help="tokens per position llama-server returns")
    parser.add_argument("--out", default="gguf_quality")
    add_cpu_isa(parser)
    return parser.parse_args()


def reference_model(model: Path, gguf: Path):
    """transformers on the file, every tensor dequantized to fp32: (the model, where its config comes from).
    transformers maps no rope scaling from GGUF metadata (llama3's rope_freqs are dropped), so a folder's
    config.json, where there is one, gives the hyperparameters; the weights are the file's either way."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    extra, source = {}, "the file's metadata (transformers maps no rope scaling from it)"
    if model.is_dir() and (model / "config.json").is_file():
        extra, source = {"config": AutoConfig.from_pretrained(model)}, "the folder's config.json"
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra)
    return ref.eval(), source


def reference(model: Path, gguf: Path, prompts: list[list[int]], tokens: int):
    """transformers on the file in fp32: (greedy continuations, log-softmax [tokens, vocab] at each of their
    positions, where its config came from)."""
    import torch
    ref, source = reference_model(model, gguf)
    ref.generation_config.eos_token_id = None  # EOS does not stop it
    continuations, logps = [], []
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                     output_logits=True, return_dict_in_generate=True)
            continuations.append(out.sequences[0, len(prompt):].tolist())
            logps.append(torch.log_softmax(torch.cat(out.logits).float(), -1))  # [tokens, vocab], raw logits
            print(f"   reference prompt {index + 1}/{len(prompts)}", flush=True)
    return continuations, logps, source


def llama_tops(server_bin: Path, gguf: Path, prompts, continuations, args) -> list:
    """llama-server's top-k (ids, logprobs) [positions, k] along each continuation, teacher-forced."""
    with llamacpp.Server(server_bin, gguf, args.threads, slots=1) as server:
        return [as_tensors([server.next_token_top(p + r[:i], args.top_k) for i in range(len(r))])
                for p, r in zip(prompts, continuations)]


def engine_mode(model: Path, activation_quant: str, prompts, continuations, ref_logps, peer, top_k: int) -> dict:
    """The engine's figures for one activation mode against the reference and, where given, llama.cpp."""
    import torch

    from kernels.linear import invariant_linear
    from kernels.ops import get_ops
    from services.core.errors import InvalidArgument
    from services.worker.loader import load_model
    try:
        engine = load_model(model, torch.float32, torch.device("cpu"), get_ops("cpu", "cpu"), invariant_linear,
                            "gguf", activation_quant=activation_quant)
    except InvalidArgument as refused:
        return {"refused": str(refused)}
    agree, kls, top_kls, peer_kls, peer_agree = [], [], [], [], []
    for index, (p, r, ref) in enumerate(zip(prompts, continuations, ref_logps)):
        logp = torch.log_softmax(full_logits(engine, p + r)[len(p) - 1:-1], -1)
        agree.append((logp.argmax(-1) == ref.argmax(-1)).double().mean().item())
        kls.append((ref.exp() * (ref - logp)).sum(-1).mean().item())
        top = logp.topk(min(top_k, logp.shape[-1]), -1)  # the engine's top-k + rest, as llama.cpp's is measured
        top_kls.append(bucket_kl(ref, top.indices, top.values).mean().item())
        if peer is not None:
            ids, logps = peer[index]
            peer_kls.append(bucket_kl(logp, ids, logps).mean().item())
            peer_agree.append((ids[:, 0] == logp.argmax(-1)).double().mean().item())
    positions = sum(len(r) for r in continuations)
    out = {"agreement": statistics.mean(agree), "mean_kl_nats": statistics.mean(kls),
           "mean_topk_kl_nats": statistics.mean(top_kls), "positions": positions,
           "agreeing": round(statistics.mean(agree) * positions), "target": TARGETS[activation_quant]}
    if peer is not None:
        out["vs_llama_cpp"] = {"mean_topk_kl_nats": statistics.mean(peer_kls),
                               "argmax_agreement": statistics.mean(peer_agree)}
    return out


def llama_vs_reference(peer, ref_logps) -> dict:
    agree = [(ids[:, 0] == ref.argmax(-1)).double().mean().item() for (ids, _), ref in zip(peer, ref_logps)]
    kls = [bucket_kl(ref, ids, logps).mean().item() for (ids, logps), ref in zip(peer, ref_logps)]
    positions = sum(len(ids) for ids, _ in peer)
    return {"agreement": statistics.mean(agree), "mean_topk_kl_nats": statistics.mean(kls), "positions": positions,
            "agreeing": round(statistics.mean(agree) * positions)}


def wilson(agreeing: int, positions: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a share agreeing / positions. The positions of one prompt are not
    independent (a wrong token makes its neighbours likelier wrong), so the true interval is somewhat wider."""
    if positions == 0:
        return 0.0, 1.0
    share, z2 = agreeing / positions, z * z
    centre = (share + z2 / (2 * positions)) / (1 + z2 / positions)
    half = z * math.sqrt(share * (1 - share) / positions + z2 / (4 * positions * positions)) / (1 + z2 / positions)
    return max(0.0, centre - half), min(1.0, centre + half)


def share_text(r: dict) -> str:
    """'97.27% (1024 positions; 95% CI 96.1-98.1%)'."""
    low, high = wilson(r["agreeing"], r["positions"])
    return f"{100 * r['agreement']:.2f}% ({r['positions']} positions; 95% CI {100 * low:.1f}-{100 * high:.1f}%)"


def one_file(argument: str, args, server_bin) -> dict:
    model = model_path(argument)
    gguf = gguf_path(model)
    kind = type_label(gguf)
    print(f"== {argument}: {kind}", flush=True)
    prompts = [r.prompt_ids for r in sharegpt_requests(args.prompts, model, args.seed, args.max_prompt_len,
                                                       args.tokens, args.sharegpt_path)]
    continuations, ref_logps, source = reference(model, gguf, prompts, args.tokens)
    result = {"model": argument, "file": gguf.name if argument == "default" else Path(argument).name, "type": kind,
              "tensors": mix_text(gguf), "reference_config": source, "modes": {}}
    peer = None
    if server_bin[0] is not None:
        peer = llama_tops(server_bin[0], gguf, prompts, continuations, args)
        result["llama_cpp"] = llama_vs_reference(peer, ref_logps)
    else:
        result["llama_cpp_skipped"] = server_bin[1]
    for mode in args.activations.split(","):
        result["modes"][mode] = engine_mode(model, mode, prompts, continuations, ref_logps, peer, args.top_k)
        print(f"   {LABELS[mode]}: {result['modes'][mode]}", flush=True)
    return result


def rows_for(result: dict) -> list[list]:
    rows = []
    for mode, r in result["modes"].items():
        head = [result["file"], result["type"], f"engine, {LABELS[mode]}"]
        if "refused" in r:
            rows.append([*head, "not served", r["refused"], "", "", ""])
            continue
        met = "met" if r["agreement"] >= r["target"] else "**missed**"
        peer = r.get("vs_llama_cpp")
        rows.append([*head, f"{share_text(r)}, >= {100 * r['target']:.0f}%: {met}",
                     f"{max(r['mean_kl_nats'], 0.0):.5f}",  # -0.00000: rounding
                     f"{peer['mean_topk_kl_nats']:.5f}" if peer else "n/a",
                     f"{100 * peer['argmax_agreement']:.2f}%" if peer else "n/a",
                     f"{max(r['mean_topk_kl_nats'], 0.0):.5f}"])
    if "llama_cpp" in result:
        r = result["llama_cpp"]
        rows.append([result["file"], result["type"], "llama.cpp (llama-server)", share_text(r), "",
                     "", "", f"{max(r['mean_topk_kl_nats'], 0.0):.5f}"])
    return rows


def report(results: list[dict], args) -> str:
    headers = ["file", "type", "contender", "teacher-forced agreement with the reference",
               "mean KL(reference || engine), nats", f"KL(engine || llama.cpp), its top-{args.top_k} + rest",
               "argmax agreement with llama.cpp",
               f"KL(reference || contender) over the contender's top-{args.top_k} + rest (comparable across rows)"]
    rows = [row for result in results for row in rows_for(result)]
    mixes = "\n".join(f"- {r['file']} ({r['type']}): {r['tensors']}; reference config: {r['reference_config']}"
                      for r in results)
    skipped = next((r["llama_cpp_skipped"] for r in results if "llama_cpp_skipped" in r), None)
    return (f"{args.prompts} ShareGPT prompts (<= {args.max_prompt_len} tokens, seed {args.seed}) x {args.tokens} "
            f"tokens, teacher-forced on the reference's greedy continuation; reference: transformers on the same "
            f"file dequantized to fp32; {args.threads} threads; CPU kernel tier {args.tier}."
            + (f" llama.cpp skipped: {skipped}." if skipped else "") + "\n\n"
            + markdown_table(headers, rows) + "\nTensor types (the norms' F32 left out) and where the reference's "
            "config came from (a bare file with llama3 rope scaling needs its folder's):\n\n" + mixes + "\n")


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    import torch
    torch.set_num_threads(args.threads)
    args.tier = select_tier(args.cpu_isa, args.libraries_isa)
    server_bin = llamacpp.binary(args.llama_cpp_dir, "llama-server")
    title = "Quality per GGUF type: the engine against transformers and llama.cpp on the same file"
    results = []
    for model in args.models[:-1]:  # the results file rewritten after each: a long run cut short keeps what it measured
        results.append(one_file(model, args, server_bin))
        write_results(args.out, title, load_before, report(results, args), {"files": results})
    results.append(one_file(args.models[-1], args, server_bin))
    show_results(args.out, title, load_before, report(results, args), {"files": results})


if __name__ == "__main__":
    main()
