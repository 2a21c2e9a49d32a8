"""Where int8 activations lose next-token agreement (docs/guide/gguf.md, "Quality per type"): transformers on a
GGUF file dequantized to fp32 (the reference), the same with every linear's input rounded in torch as the engine
rounds it (per block of 32, or super-block of 256 for the K-quants and IQ4_XS, by that weight's type: d = amax / 127,
q = round-half-even(x / d)) and everything else fp32, variants, and the engine's own int8 path; teacher-forced over
every position of ShareGPT prompts (cheaper than gguf_quality.py's greedy continuations, and lower: a prompt's own
text is less predictable). If the engine's row equals "sim" the kernels add nothing to the rounding.

    python bench/int8_rounding.py MODEL --prompts 8 --modes sim,engine,sim_headonly

Modes: sim (every quantized linear's input rounded), engine (the engine, --activation-quant int8), engine_fp32,
sim16 (llama.cpp's fp16 d on the blocks of 32), sim16kv (and K, V rounded to f16, llama.cpp's KV cache), sim32
(blocks of 32 for every type), sim_headonly / sim_nohead (the output head's input only / all but it),
sim_downonly / sim_nodown (the same for down_proj). Prints; writes nothing.
"""
import sys, math, time, argparse
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import torch, numpy as np
from activation_quality import full_logits
from workload import sharegpt_requests
from gguf_files import gguf_path, model_path
from gguf_quality import reference_model
import gguf

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("model", help="what --model takes: a GGUF file or a folder with config.json and one GGUF")
p.add_argument("--prompts", type=int, default=16)
p.add_argument("--max-len", type=int, default=128, help="prompt tokens at most")
p.add_argument("--modes", default="sim,engine")
args = p.parse_args()
torch.set_num_threads(1)
model = model_path(args.model)
g = gguf_path(model)
reader = gguf.GGUFReader(g)
KQ = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
spans, types = {}, {}
for t in reader.tensors:
    ty = t.tensor_type.name
    if t.name.startswith("blk."):
        _, i, kind, _ = t.name.split(".")
        if kind not in NAMES: continue
        hf = f"model.layers.{i}.{NAMES[kind]}"
    elif t.name == "output.weight": hf = "lm_head"
    elif t.name == "token_embd.weight": hf = "lm_head_tied"
    else: continue
    types[hf] = ty
    spans[hf] = None if ty in ("F32", "F16", "BF16") else 256 if ty in KQ else 32
if "lm_head" not in spans: spans["lm_head"], types["lm_head"] = spans["lm_head_tied"], types["lm_head_tied"]
print("types:", sorted(set(types.values())), flush=True)

def fake(x, span, d16):
    shape = x.shape; k = shape[-1]; b = -(-k // span)
    xp = torch.zeros(*shape[:-1], b * span); xp[..., :k] = x
    xp = xp.view(*shape[:-1], b, span)
    amax = xp.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax.clamp_min(1e-30), torch.zeros_like(amax))
    q = torch.round(xp * inv)
    if d16 and span == 32: d = d.half().float()
    return (q * d).view(*shape[:-1], b * span)[..., :k]

prompts = [r.prompt_ids for r in sharegpt_requests(args.prompts, model, 0, args.max_len, 1, None)]
ref, _ = reference_model(model, g)
def run_hf():
    out = []
    with torch.no_grad():
        for pr in prompts:
            out.append(torch.log_softmax(ref(torch.tensor([pr])).logits[0].float(), -1))
    return out
t = time.time(); base = run_hf(); print("ref", time.time() - t, flush=True)
n = sum(len(b) for b in base)
top2 = torch.cat([b.topk(2, -1).values for b in base]); gap = (top2[:, 0] - top2[:, 1])
print(f"positions {n}; ref top1-top2 logprob gap: median {gap.median():.4f}, share < 0.01: {(gap < 0.01).float().mean():.3f}, < 0.05: {(gap < 0.05).float().mean():.3f}", flush=True)

def score(name, logps):
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(logps, base))
    kl = torch.cat([(b.exp() * (b - a)).sum(-1) for a, b in zip(logps, base)]).mean().item()
    s = agree / n; z = 1.96; c = (s + z*z/(2*n)) / (1 + z*z/n); h = z*math.sqrt(s*(1-s)/n + z*z/(4*n*n)) / (1 + z*z/n)
    print(f"{name:28s} agreement {100*s:6.2f}% [{100*(c-h):.1f}, {100*(c+h):.1f}] ({agree}/{n})  mean KL {kl:.5f}", flush=True)

def with_hooks(d16, kv16, only=None, force_span=None):
    handles = []
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear):
            if kv16 and name.endswith(("k_proj", "v_proj")):
                handles.append(mod.register_forward_hook(lambda m, a, o: o.half().float()))
            span = spans.get(name)
            if span is None or (only and not only(name)): continue
            span = force_span or span
            handles.append(mod.register_forward_pre_hook(lambda m, a, span=span: (fake(a[0], span, d16),)))
    try:
        return run_hf()
    finally:
        for h in handles: h.remove()

for mode in args.modes.split(","):
    t = time.time()
    if mode == "sim": out = with_hooks(False, False)
    elif mode == "sim16": out = with_hooks(True, False)
    elif mode == "sim16kv": out = with_hooks(True, True)
    elif mode == "kv16": out = with_hooks(False, True, only=lambda n: False)
    elif mode == "sim32": out = with_hooks(False, False, force_span=32)
    elif mode == "sim_nodown": out = with_hooks(False, False, only=lambda n: not n.endswith("down_proj"))
    elif mode == "sim_downonly": out = with_hooks(False, False, only=lambda n: n.endswith("down_proj"))
    elif mode == "sim_nohead": out = with_hooks(False, False, only=lambda n: n != "lm_head")
    elif mode == "sim_headonly": out = with_hooks(False, False, only=lambda n: n == "lm_head")
    elif mode in ("engine", "engine_fp32"):
        from kernels.linear import invariant_linear
        from kernels.ops import get_ops
        from services.worker.loader import load_model
        eng = load_model(model, torch.float32, torch.device("cpu"), get_ops("cpu", "cpu"), invariant_linear, "gguf",
                         activation_quant="int8" if mode == "engine" else "none")
        out = [torch.log_softmax(full_logits(eng, pr), -1) for pr in prompts]
        del eng
    score(mode, out); print("   ", round(time.time() - t), "s", flush=True)
