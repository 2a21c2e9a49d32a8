"""Random-weight checkpoints of the architectures beyond the Llama family, built from each
architecture's own transformers config class: the config.json is the class's, and the tensor
names and shapes are those of the transformers model it makes (on the meta device: no memory).
services/tools/make_model.py writes them; the scales follow services/tools/random_weights.py.
"""
from __future__ import annotations

import math

from services.tools.make_tokenizer import BOS_ID, EOS_ID
from services.tools.random_weights import BIAS_STD, LOGIT_STD, NORM_NOISE, QK_GAIN, ParamSpec

# arch -> (transformers config class, architectures entry)
ARCHS = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


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


_ARCH_SETTINGS = {"gemma3": _gemma3}


def arch_param_specs(config: dict) -> list[ParamSpec]:
    """Every tensor of the transformers model `config` makes, with random-weight scales."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    offset_norms = config["model_type"].startswith("gemma")  # RMSNorm scales by (1 + w)
    return [_spec(name, tuple(p.shape), config["hidden_size"], offset_norms) for name, p in model.named_parameters()]


def _spec(name: str, shape: tuple[int, ...], hidden: int, offset_norms: bool) -> ParamSpec:
    if len(shape) == 1 and "norm" in name:
        return ParamSpec(name=name, shape=shape, mean=0.0 if offset_norms else 1.0, std=NORM_NOISE)
    if len(shape) == 1:  # a bias
        return ParamSpec(name=name, shape=shape, mean=0.0, std=BIAS_STD)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return ParamSpec(name=name, shape=shape, mean=0.0, std=LOGIT_STD / math.sqrt(hidden))
    gain = QK_GAIN if any(p in name for p in ("q_proj", "k_proj", "qkv_proj")) else 1.0
    return ParamSpec(name=name, shape=shape, mean=0.0, std=gain / math.sqrt(shape[-1]))
