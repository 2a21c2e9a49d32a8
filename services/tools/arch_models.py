"""Random-weight checkpoints of the architectures beyond the Llama family, built from each
architecture's own transformers config class: the config.json is the class's, and the tensor
names and shapes are those of the transformers model it makes (on the meta device: no memory).
services/tools/make_model.py writes them; the scales follow services/tools/random_weights.py.
"""
from __future__ import annotations

import math

from services.tools.make_tokenizer import BOS_ID, EOS_ID
from services.tools.random_weights import BIAS_STD, LOGIT_STD, NORM_NOISE, QK_GAIN, ParamSpec

ROUTER_GAIN = 3.0

# arch -> (transformers config class, architectures entry)
ARCHS = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
         "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
         "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


def arch_config(arch: str, s: dict) -> dict:
    """config.json of `arch` (transformers' own class and defaults) with a size preset's settings `s`."""
    import transformers

    class_name, architecture = ARCHS[arch]
    kwargs = dict(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
        vocab_size=s["vocab_size"], max_position_embeddings=s["max_position_embeddings"],
        tie_word_embeddings=s["tie_word_embeddings"], rms_norm_eps=s.get("rms_norm_eps", 1e-6),
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    kwargs.update(_ARCH_SETTINGS[arch](s))
    config = getattr(transformers, class_name)(**kwargs).to_dict()
    for key in ("transformers_version", "id2label", "label2id", "_name_or_path", "output_attentions",
                "output_hidden_states", "return_dict"):
        config.pop(key, None)
    config.update(architectures=[architecture], torch_dtype=s["dtype"], dtype=s["dtype"])
    return config


def _gemma3(s: dict) -> dict:
    """Both layer kinds in any depth (every second layer global), a window shorter than the test
    prompts, an attention scale that is not head_dim's, and the final logit soft-cap on."""
    layers = s["num_layers"]
    return dict(sliding_window=s.get("sliding_window", 64), query_pre_attn_scalar=2 * s["head_dim"],
                layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
                final_logit_softcapping=30.0,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": s["rope_theta"]}})


def _phi3(s: dict) -> dict:
    """Phi-4-mini's features at a small size: 3/4 of each head rotates, LongRoPE over a pre-training
    context of a quarter of the model's (short factors inside it, long past it; the attention factor
    from their ratio), and a sliding window (Phi-3-mini has one) shorter than the test prompts.
    head_dim is hidden_size / num_heads (Phi3Config has no head_dim)."""
    rotary = int(s["hidden_size"] // s["num_heads"] * 0.75)
    steps = _ramp(rotary // 2)
    original = s["max_position_embeddings"] // 4
    return dict(partial_rotary_factor=0.75, original_max_position_embeddings=original,
                sliding_window=s.get("sliding_window", 64),
                rope_parameters={"rope_type": "longrope", "rope_theta": s["rope_theta"], "partial_rotary_factor": 0.75,
                                 "factor": s["max_position_embeddings"] / original,
                                 "short_factor": [1.0 + 0.5 * x for x in steps],
                                 "long_factor": [1.0 + 7.0 * x for x in steps],
                                 "original_max_position_embeddings": original})


def _ramp(n: int) -> list[float]:
    return [i / max(1, n - 1) for i in range(n)]


def _qwen3_moe(s: dict) -> dict:
    """8 experts of half the MLP width, 2 a token, the top-k weights not renormalised (the config's
    default; Qwen3-30B-A3B sets norm_topk_prob, Mixtral always renormalises); the benchmarks' shapes set
    num_experts, experts_per_token and moe_intermediate_size (Qwen3-30B-A3B: 128, 8, 768)."""
    return dict(num_experts=s.get("num_experts") or 8, num_experts_per_tok=s.get("experts_per_token") or 2,
                moe_intermediate_size=s.get("moe_intermediate_size") or s["intermediate_size"] // 2,
                norm_topk_prob=False, rope_theta=s["rope_theta"])


def _mixtral(s: dict) -> dict:
    return dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None, rope_theta=s["rope_theta"])


def _gpt_oss(s: dict) -> dict:
    """gpt-oss-20b's features at a small size: sliding (64 keys, shorter than the test prompts) and full
    layers alternating, YaRN over a pre-training context of a sixteenth of the model's (factor 16), 8 experts (4 a
    token), and a SwiGLU limit low enough that random weights reach the clamp."""
    layers = s["num_layers"]
    return dict(num_local_experts=8, num_experts_per_tok=4, sliding_window=s.get("sliding_window", 64),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                swiglu_limit=1.0, attention_bias=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": s["rope_theta"], "factor": 16.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": max(1, s["max_position_embeddings"] // 16)})


_ARCH_SETTINGS = {"gemma3": _gemma3, "phi3": _phi3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
                  "gpt_oss": _gpt_oss}


def arch_param_specs(config: dict) -> list[ParamSpec]:
    """Every tensor of the transformers model `config` makes, with random-weight scales."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    offset_norms = config["model_type"].startswith("gemma")  # RMSNorm scales by (1 + w)
    input_major = config["model_type"] == "gpt_oss"  # its experts are stored [E, in, out]
    return [_spec(name, tuple(p.shape), config["hidden_size"], offset_norms, input_major)
            for name, p in model.named_parameters()]


SINK_STD = 1.0  # gpt-oss's sink logits: as large as the scores, so that they move the attention



def _spec(name: str, shape: tuple[int, ...], hidden: int, offset_norms: bool, input_major: bool = False) -> ParamSpec:
    if name.endswith("self_attn.sinks"):
        return ParamSpec(name=name, shape=shape, mean=0.0, std=SINK_STD)
    if len(shape) == 1 and "norm" in name:
        return ParamSpec(name=name, shape=shape, mean=0.0 if offset_norms else 1.0, std=NORM_NOISE)
    if len(shape) == 1 or name.endswith("_bias"):  # a bias (gpt-oss's experts': [E, out])
        return ParamSpec(name=name, shape=shape, mean=0.0, std=BIAS_STD)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return ParamSpec(name=name, shape=shape, mean=0.0, std=LOGIT_STD / math.sqrt(hidden))
    gain = QK_GAIN if any(p in name for p in ("q_proj", "k_proj", "qkv_proj")) else 1.0
    if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # a router: clear preferences, rarely a near-tie
        gain = ROUTER_GAIN
    fan_in = shape[-2] if input_major and len(shape) == 3 else shape[-1]
    return ParamSpec(name=name, shape=shape, mean=0.0, std=gain / math.sqrt(fan_in))
