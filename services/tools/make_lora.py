"""Write a random LoRA adapter in the PEFT format for a make_model folder, for tests and benchmarks.

    python -m services.tools.make_lora --model DIR --out DIR [--rank 8] [--alpha 16] [--seed 0]
        [--targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj] [--use-rslora]

or from Python: `make_lora(out_dir, model_dir, rank=8, alpha=16, seed=0, targets=..., use_rslora=False)`.

The folder holds adapter_config.json and adapter_model.safetensors under PEFT's tensor names
(base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight [r, in], ...lora_B.weight [out, r]),
as `PeftModel.save_pretrained` writes them. Unlike a fresh PEFT adapter, whose B starts at zero, both
factors are random, so the adapter changes the model's outputs. The same arguments give the same files.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """PEFT target -> (its block, in features, out features) for a Llama-family config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter), "down_proj": ("mlp", inter, hidden)}


def make_lora(out_dir: str | Path, model_dir: str | Path, rank: int = 8, alpha: float = 16, seed: int = 0,
              targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, magnitude: float = 0.5) -> Path:
    """A random adapter for the model in `model_dir` (its config.json); magnitude: the typical size of the
    adapter's product relative to its input, before alpha / r."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = _shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            block, fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * magnitude / rank ** 0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none",
        "use_rslora": use_rslora, "fan_in_fan_out": False, "modules_to_save": None, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the make_model folder the adapter is for")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=",".join(ALL_TARGETS))
    parser.add_argument("--use-rslora", action="store_true")
    args = parser.parse_args(argv)
    print(make_lora(args.out, args.model, args.rank, args.alpha, args.seed, tuple(args.targets.split(",")),
                    args.use_rslora))


if __name__ == "__main__":
    main()
