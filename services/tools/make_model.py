"""Make a Hugging Face checkpoint folder with random weights, for tests and benchmarks.

No test or benchmark reaches a model hub: they build their models with this tool.

    python -m services.tools.make_model --arch {llama,qwen2,qwen3,gemma3} \\
        --size {tiny,small,bench,1b} --seed N --dtype {float32,bfloat16} \\
        [--tie-word-embeddings | --no-tie-word-embeddings] [--rope-scaling-llama3] \\
        [--hidden-size N] [--num-layers N] [--num-heads N] [--num-kv-heads N] \\
        [--head-dim N] [--intermediate-size N] [--vocab-size N] \\
        [--max-position-embeddings N] [--rope-theta X] [--rms-norm-eps X] --out DIR

--dtype defaults to the size's own: float32, except bfloat16 for 1b.

or from Python: `make_model(out_dir, arch="llama", size="tiny", seed=0, dtype=None, **overrides)`.

The folder holds config.json, generation_config.json, model.safetensors (HF parameter
names), tokenizer.json, tokenizer_config.json (ChatML chat template) and
special_tokens_map.json. The same arguments give byte-identical files. Sizes (llama
parameter counts; qwen2 adds q/k/v biases, qwen3 q/k norms):

    tiny   hidden 64,   2 layers,  4/2 heads,  head_dim 16, mlp 128,  vocab 512    (139,584 params)
    small  hidden 128,  4 layers,  4/2 heads,  head_dim 32, mlp 352,  vocab 1024   (1,000,576)
    bench  hidden 768,  12 layers, 12/4 heads, head_dim 64, mlp 2560, vocab 8192   (102,255,360)
    1b     Llama-3.2-1B shape: hidden 2048, 16 layers, 32/8 heads, head_dim 64, mlp 8192,
           vocab 32000, tied embeddings, llama3 rope scaling, bfloat16    (1,038,682,112)

qwen3_moe takes --num-experts, --experts-per-token and --moe-intermediate-size (default 8, 2 and half
of --intermediate-size).

gpt_oss (services/tools/arch_models.py): transformers' GptOssConfig with the size's shapes, sliding and
full layers alternating (window 64), YaRN rope, 8 experts of 4 a token, attention sinks.

bert, bert_classifier (services/tools/encoder_models.py): transformers' BertModel with a
sentence-transformers layout beside it (mean pooling, normalised), and BertForSequenceClassification
with one label (a cross-encoder); their tokenizer adds <|im_start|> / <|im_end|> as [CLS] / [SEP].
bert_wordpiece: `bert` with a WordPiece vocabulary ([PAD] [CLS] [SEP] [UNK] [MASK] = 0..4), BERT's own kind,
which llama.cpp's converter and tokenizer read.

gemma3 (services/tools/arch_models.py): transformers' Gemma3TextConfig with the size's shapes,
every second layer global, a sliding window of 64, the final logit soft-cap; its tensors those of
transformers' Gemma3ForCausalLM.

Special tokens: <|endoftext|> = 0, <|im_start|> = 1 (BOS), <|im_end|> = 2 (EOS).
generation_config.json lists both 2 and 0 as EOS ids.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from services.tools.arch_models import ARCHS, arch_config, arch_param_specs
from services.tools.encoder_models import ENCODERS, encoder_config, encoder_param_specs, write_encoder_files
from services.tools.make_tokenizer import BOS_ID, ENDOFTEXT_ID, EOS_ID, write_tokenizer_files
from services.tools.random_weights import count_params, param_specs, write_random_safetensors

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 **{arch: architecture for arch, (_, architecture) in ARCHS.items()}, **ENCODERS}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SMALL = dict(max_position_embeddings=2048, rope_theta=10000.0, rope_scaling_llama3=False,
              tie_word_embeddings=False, dtype="float32")
SIZES = {
    "tiny": dict(_SMALL, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512),
    "small": dict(_SMALL, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=352, vocab_size=1024),
    "bench": dict(_SMALL, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
                  intermediate_size=2560, vocab_size=8192),
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=32000, max_position_embeddings=131072,
               rope_theta=500000.0, rope_scaling_llama3=True, tie_word_embeddings=True, dtype="bfloat16"),
}
MOE_OVERRIDES = ("num_experts", "experts_per_token", "moe_intermediate_size")  # qwen3_moe (arch_models.py)
OVERRIDES = (frozenset(SIZES["tiny"]) - {"dtype"}) | {"rms_norm_eps", *MOE_OVERRIDES}


def make_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
               dtype: str | None = None, **overrides) -> Path:
    """Write a random-weight checkpoint folder and return its path.

    `dtype` defaults to the size's own (bfloat16 for 1b, float32 otherwise); any key
    of a size preset (hidden_size, num_layers, vocab_size, tie_word_embeddings, ...)
    can be overridden by keyword.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    unknown = set(overrides) - OVERRIDES
    if unknown:
        raise TypeError(f"unknown overrides {sorted(unknown)}; allowed: {sorted(OVERRIDES)}")
    settings = {**SIZES[size], **overrides}
    if dtype is not None:
        settings["dtype"] = dtype
    if settings["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {settings['dtype']!r}")
    config = model_config(arch, settings)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, ENDOFTEXT_ID], "pad_token_id": EOS_ID})
    write_tokenizer_files(out, config["vocab_size"], config["max_position_embeddings"])
    write_random_safetensors(out / "model.safetensors", _specs(arch, config), seed, DTYPES[settings["dtype"]])
    if arch in ENCODERS:
        write_encoder_files(out, arch)
    return out


def _specs(arch: str, config: dict):
    if arch in ENCODERS:
        return encoder_param_specs(config)
    return arch_param_specs(config) if arch in ARCHS else param_specs(config)


def model_config(arch: str, s: dict) -> dict:
    """The HF config.json of `arch` with the settings `s` of a size preset."""
    if arch in ARCHS:
        return arch_config(arch, s)
    if arch in ENCODERS:
        return encoder_config(arch, s)
    qwen = arch != "llama"
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_layers"],
        "num_attention_heads": s["num_heads"],
        "num_key_value_heads": s["num_kv_heads"],
        "head_dim": s["head_dim"],
        "rms_norm_eps": s.get("rms_norm_eps", 1e-6 if qwen else 1e-5),
        "rope_theta": s["rope_theta"],
        "rope_scaling": _llama3_rope_scaling(s["max_position_embeddings"]) if s["rope_scaling_llama3"] else None,
        "max_position_embeddings": s["max_position_embeddings"],
        "vocab_size": s["vocab_size"],
        "tie_word_embeddings": s["tie_word_embeddings"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": s["dtype"],
    }
    if arch != "qwen2":  # qwen2 has q/k/v biases and no attention_bias key
        config["attention_bias"] = False
    if arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=s["num_layers"])
    return config


def _llama3_rope_scaling(max_position_embeddings: int) -> dict:
    # Llama 3.2 uses factor 32 over an original 8192-token context; the small models
    # keep factor 32 over an original context of 1/16 of theirs (128 for 2048), so
    # the scaling changes the rotation of most frequencies even in short tests.
    return {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(1, max_position_embeddings // 16)}


def num_parameters(arch: str = "llama", size: str = "tiny", **overrides) -> int:
    """Parameter count of the model `make_model` would write (tied weights counted once)."""
    return count_params(_specs(arch, model_config(arch, {**SIZES[size], **overrides})))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    overrides = {key: value for key, value in vars(args).items()
                 if key in OVERRIDES and value is not None}
    out = make_model(args.out, args.arch, args.size, args.seed, args.dtype, **overrides)
    print(f"wrote {args.arch}/{args.size} ({num_parameters(args.arch, args.size, **overrides):,} parameters) to {out}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.tools.make_model", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the size's own")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--rope-scaling-llama3", action=argparse.BooleanOptionalAction, default=None)
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", *MOE_OVERRIDES):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=None)
    p.add_argument("--rms-norm-eps", type=float, default=None)
    return p


if __name__ == "__main__":
    main()
