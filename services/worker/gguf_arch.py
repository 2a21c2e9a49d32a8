"""What each GGUF architecture served is: its model type, tensor names and hyperparameter keys.

One row per `general.architecture` (`ARCHITECTURES`); an architecture added to the models
(services/worker/model_config.py `SUPPORTED`) is served from a bare GGUF file by a row here: the
model_type it is, its layer tensors beyond the common ones, and whether llama.cpp's converter
permuted its q/k rows (convert_hf_to_gguf.py does for `llama`, `undo_permute`; not for the others), whether
its norms already hold what the model's finish_load makes of them (Gemma's 1 + w), and the model_type a file
with experts is (a `llama` file with expert_count is Mixtral). The hyperparameters are read under `{arch}.`
with llama.cpp's key names and handed to `ModelArchConfig.from_dict` as the config.json keys they stand for;
where llama.cpp's loader assumes what the file does not say (Gemma 3's attention scale and default layer
pattern, the renormalised top-k of Qwen3-MoE), so does this.

The encoders (`bert`, as convert_hf_to_gguf.py's BertModel writes it) are not rows of ARCHITECTURES: their
tensors map to transformers' BertModel names (`ENCODER_NAMES`, `encoder_hf_name`) for the encoder's own
loader (services/worker/models/bert.py), and their keys to BertConfig's (`_encoder_config`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.core.errors import InvalidArgument
from services.core.gguf_file import read_metadata, read_tensor, tensor_shapes

# GGUF (llama.cpp) tensor names -> Hugging Face names; {i} is the layer index.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QKV_BIAS = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
            "attn_v.bias": "self_attn.v_proj.bias"}
QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
GEMMA3_NAMES = {**QK_NORM,  # convert_hf_to_gguf.py's Gemma3Model: four norms a layer, each holding 1 + w
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
PHI3_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight",  # fused, split by rows at read (gguf_weights.py)
              "ffn_up.weight": "mlp.gate_up_proj.weight"}  # llama.cpp's phi3 ffn_up: gate and up, 2 x n_ff rows
EXPERTS = {"ffn_gate_inp.weight": "mlp.gate.weight",  # the router (kept F32 by llama.cpp)
           # each [experts, rows, cols], split per expert at read (gguf_weights.py) under "mlp.experts.E."
           "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight", "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
           "ffn_down_exps.weight": "mlp.experts.down_proj.weight"}
GPT_OSS_NAMES = {**QKV_BIAS, **EXPERTS,  # convert_hf_to_gguf.py's GptOssModel (conversion/gpt_oss.py)
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
                 "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                 # the experts MXFP4 (dequantized at load, loader.py), gate and up de-interleaved by the
                 # converter; their biases [experts, out], split per expert at read like the weights
                 "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias", "ffn_up_exps.bias": "mlp.experts.up_proj.bias",
                 "ffn_down_exps.bias": "mlp.experts.down_proj.bias"}
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"  # Phi-3's LongRoPE factors
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rotary scaling, as llama.cpp stores it: a factor per frequency

# The encoders (llama.cpp's "bert": convert_hf_to_gguf.py's BertModel) under transformers' BertModel names,
# read by services/worker/models/bert.py's own loader (gguf_weights.read_encoder_tensors)
ENCODER_ARCHITECTURES = {"bert": "bert"}  # general.architecture -> config.json's model_type
ENCODER_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight", "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
ENCODER_LAYER_NAMES = {  # each with its .weight and .bias
    "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}


@dataclass(frozen=True, kw_only=True)
class GgufArch:
    model_type: str  # services/worker/model_config.py SUPPORTED's key
    permuted_qk: bool  # llama.cpp's converter permuted the q/k rows for its rotary layout
    layer_names: dict[str, str] = field(default_factory=dict)  # beyond LAYER_NAMES (biases are optional)
    # the norm weights hold what the model's finish_load makes of the checkpoint's (Gemma's 1 + w, which
    # llama.cpp's converter adds): loading the file skips finish_load
    norms_as_served: bool = False
    moe_model_type: str | None = None  # the model_type of a file of this architecture with experts (expert_count)


ARCHITECTURES = {  # general.architecture -> how it is served (Mistral's GGUF files say "llama")
    "llama": GgufArch(model_type="llama", permuted_qk=True, layer_names={**QKV_BIAS, **EXPERTS},
                      moe_model_type="mixtral"),  # Mixtral's files are llama ones with experts
    "qwen2": GgufArch(model_type="qwen2", permuted_qk=False, layer_names=QKV_BIAS),
    "qwen3": GgufArch(model_type="qwen3", permuted_qk=False, layer_names=QK_NORM),
    "qwen3moe": GgufArch(model_type="qwen3_moe", permuted_qk=False, layer_names={**QK_NORM, **EXPERTS},
                         moe_model_type="qwen3_moe"),
    "phi3": GgufArch(model_type="phi3", permuted_qk=False, layer_names=PHI3_NAMES),
    "gemma3": GgufArch(model_type="gemma3_text", permuted_qk=False, layer_names=GEMMA3_NAMES, norms_as_served=True),
    "gpt-oss": GgufArch(model_type="gpt_oss", permuted_qk=False, layer_names=GPT_OSS_NAMES, moe_model_type="gpt_oss"),
}


def architecture(meta: dict, path: Path) -> tuple[str, GgufArch]:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise InvalidArgument("model", f"{path.name}: architecture {arch!r} (general.architecture) is not served; "
                                       f"served GGUF architectures: {', '.join(sorted(SERVED))}")
    return arch, ARCHITECTURES[arch]


SERVED = (*ARCHITECTURES, *ENCODER_ARCHITECTURES)


def encoder_hf_name(gguf_name: str) -> str:
    """The transformers BertModel name of an encoder file's tensor."""
    if gguf_name in ENCODER_NAMES:
        return ENCODER_NAMES[gguf_name]
    prefix, layer, rest = gguf_name.split(".", 2) if gguf_name.startswith("blk.") else ("", "", "")
    kind, _, param = rest.rpartition(".")
    if prefix == "blk" and layer.isdigit() and kind in ENCODER_LAYER_NAMES and param in ("weight", "bias"):
        return f"encoder.layer.{int(layer)}.{ENCODER_LAYER_NAMES[kind]}.{param}"
    what = "a classification head (cls.*): serve a cross-encoder from its folder" if gguf_name.startswith("cls") \
        else f"not part of a served bert model (layer tensors: {', '.join(sorted(ENCODER_LAYER_NAMES))})"
    raise InvalidArgument("model", f"GGUF tensor {gguf_name!r} is {what}")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for rope_freqs and Phi-3's rope factors (read into the
    config)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if gguf_name in (ROPE_FREQS, ROPE_LONG, ROPE_SHORT):
        return None
    prefix, layer, rest = gguf_name.split(".", 2) if gguf_name.startswith("blk.") else ("", "", "")
    names = {**LAYER_NAMES, **ARCHITECTURES[arch].layer_names}
    if prefix == "blk" and layer.isdigit() and rest in names:
        return f"model.layers.{int(layer)}.{names[rest]}"
    raise InvalidArgument("model", f"GGUF tensor {gguf_name!r} is not part of a served {arch} model "
                                   f"(layer tensors: {', '.join(sorted(names))})")


def config_dict(path: str | Path) -> dict:
    """The file's hyperparameters as config.json keys (for ModelArchConfig.from_dict)."""
    path = Path(path)
    meta, shapes = read_metadata(path), tensor_shapes(path)
    if meta.get("general.architecture") in ENCODER_ARCHITECTURES:
        return _encoder_config(meta, shapes, path)
    arch, spec = architecture(meta, path)

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise InvalidArgument("model", f"{path.name} lacks {arch}.{name}")
        if isinstance(value, list):
            raise InvalidArgument("model", f"{path.name}: {arch}.{name} varies per layer; not served")
        return value

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim and arch != "phi3":
        raise InvalidArgument("model", f"{path.name}: rotary on {rope_dim} of {head_dim} head dimensions "
                                       f"(partial rotary) is not served for {arch}")
    if "token_embd.weight" not in shapes:
        raise InvalidArgument("model", f"{path.name} has no token_embd.weight")
    eos = [meta.get(f"tokenizer.ggml.{name}") for name in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(key("feed_forward_length")),
        "vocab_size": shapes["token_embd.weight"][0],
        "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, path, ROPE_FREQS in shapes),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "eos_token_id": [int(e) for e in dict.fromkeys(eos) if e is not None],
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "torch_dtype": "float32",
        **(_experts(meta, arch, spec, path) if spec.moe_model_type else {}),
        **(_phi3(meta, arch, path, rope_dim / head_dim, shapes) if arch == "phi3" else {}),
        **(_gemma3(meta, arch, int(key("block_count")), head_dim, hidden // heads) if arch == "gemma3" else {}),
        **(_gpt_oss(meta, arch, int(key("block_count"))) if arch == "gpt-oss" else {}),
    }


def _encoder_config(meta: dict, shapes: dict, path: Path) -> dict:
    """A BERT file's keys as transformers' BertConfig names them (convert_hf_to_gguf.py's BertModel writes
    bert.attention.causal false, the token types' count, the layer norm's epsilon; no classification head
    is served from a file)."""
    arch = meta["general.architecture"]
    if meta.get(f"{arch}.attention.causal", False):
        raise InvalidArgument("model", f"{path.name}: {arch}.attention.causal is true; an encoder attends both ways")
    missing = [name for name in ENCODER_NAMES if name not in shapes]
    if missing:
        raise InvalidArgument("model", f"{path.name} lacks {', '.join(missing)}")

    def key(name: str):
        if f"{arch}.{name}" not in meta:
            raise InvalidArgument("model", f"{path.name} lacks {arch}.{name}")
        return meta[f"{arch}.{name}"]

    return {
        "model_type": ENCODER_ARCHITECTURES[arch],
        "architectures": ["BertModel"],
        "hidden_size": int(key("embedding_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": int(key("attention.head_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "vocab_size": shapes["token_embd.weight"][0],
        "layer_norm_eps": f32(key("attention.layer_norm_epsilon")),
        "max_position_embeddings": shapes["position_embd.weight"][0],
        "type_vocab_size": shapes["token_types.weight"][0],
        "hidden_act": "gelu",
        "torch_dtype": "float32",
    }


def _experts(meta: dict, arch: str, spec: GgufArch, path: Path) -> dict:
    """A mixture's keys (expert_count, expert_used_count, expert_feed_forward_length where the experts' width
    is not feed_forward_length's). llama.cpp renormalises the top-k weights for both Mixtral and Qwen3-MoE
    (src/models/qwen3moe.cpp passes norm_w true; its converter writes no norm_topk_prob), so they are here
    unless the file says otherwise (expert_weights_norm)."""
    count = int(meta.get(f"{arch}.expert_count") or 0)
    if not count:
        if spec.model_type == spec.moe_model_type:
            raise InvalidArgument("model", f"{path.name} lacks {arch}.expert_count")
        return {}
    extra = {"model_type": spec.moe_model_type, "num_experts": count,
             "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
             "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True))}
    if f"{arch}.expert_feed_forward_length" in meta:
        extra["moe_intermediate_size"] = int(meta[f"{arch}.expert_feed_forward_length"])
    return extra


def _phi3(meta: dict, arch: str, path: Path, rotary: float, shapes: dict) -> dict:
    """Phi-3's keys as convert_hf_to_gguf.py's Phi3MiniModel writes them: the rotary part of each head
    (rope.dimension_count), the sliding window (0: none, Phi-4), and LongRoPE as the rope_factors_long and
    _short tensors over rope.scaling.original_context_length. The attention factor the converter stores
    (rope.scaling.attn_factor) is the one kernels/rotary.py computes from the two lengths."""
    extra = {"partial_rotary_factor": rotary, "sliding_window": int(meta.get(f"{arch}.attention.sliding_window") or 0)
             or None}
    if ROPE_LONG in shapes:
        original = int(meta[f"{arch}.rope.scaling.original_context_length"])
        context = int(meta[f"{arch}.context_length"])
        extra["original_max_position_embeddings"] = original
        extra["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                                 "factor": context / original,
                                 "long_factor": read_tensor(path, ROPE_LONG),
                                 "short_factor": read_tensor(path, ROPE_SHORT)}
    return extra


def _gemma3(meta: dict, arch: str, layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """Gemma 3's keys as llama.cpp reads them (src/models/gemma3.cpp): a sliding window where
    attention.sliding_window is set, its layers by attention.sliding_window_pattern (a flag per layer, or
    every n-th layer global; 6 where absent), the local rope base (rope.freq_base_swa), and the attention
    scale the file cannot say: head_dim ** -0.5, (hidden / heads) ** -0.5 for the 62-layer 27B."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        local = [bool(flag) for flag in pattern]
    else:
        local = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return {
        "layer_types": ["sliding_attention" if window and flag else "full_attention" for flag in local],
        "sliding_window": window,
        "rope_local_base_freq": f32(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": hidden_per_head if layers == 62 else head_dim,
        "final_logit_softcapping": cap if (cap := meta.get(f"{arch}.final_logit_softcapping")) is None else f32(cap),
    }


def _gpt_oss(meta: dict, arch: str, layers: int) -> dict:
    """gpt-oss's keys as llama.cpp reads them (src/models/openai-moe.cpp): the window, its layers by
    attention.sliding_window_pattern (a flag per layer, or every n-th layer full; 2 where absent: the even
    layers slide, as gpt-oss's layer_types), the experts' width. What the file cannot say, llama.cpp fixes
    as gpt-oss has it: the clamped SwiGLU's alpha 1.702 and limit 7.0 (src/llama-graph.cpp), the softmax
    over the top-k router logits (SOFTMAX_WEIGHT, models/gpt_oss.py's route)."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2)
    local = [bool(f) for f in pattern] if isinstance(pattern, list) else \
        [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return {"layer_types": ["sliding_attention" if window and flag else "full_attention" for flag in local],
            "sliding_window": window, "num_local_experts": int(meta[f"{arch}.expert_count"]),
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _rope_scaling(meta: dict, arch: str, path: Path, has_freqs: bool) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":  # Gemma 3 4B and up: positions divided by the factor (its global layers)
        return {"rope_type": "linear", "factor": f32(meta[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":
        return _yarn(meta, arch, path)
    if kind == "longrope" and arch == "phi3":  # its factors are tensors (_phi3)
        return None
    if kind not in (None, "none"):
        raise InvalidArgument("model", f"{path.name}: rope scaling {kind!r} ({arch}.rope.scaling.type) is not served")
    if has_freqs:  # Llama 3.1+: inverse frequencies divided by these factors
        return {"rope_type": "freq_factors", "factors": [float(f) for f in read_tensor(path, ROPE_FREQS)]}
    return None


def _yarn(meta: dict, arch: str, path: Path) -> dict:
    """YaRN as the converter writes it (TextModel.set_gguf_parameters): the factor, the pre-training
    context, beta_fast / beta_slow, the attention factor where the config set one. The ramp's bounds:
    llama.cpp always rounds them outwards (ggml_rope_yarn_corr_dims); gpt-oss's configs say truncate false
    (transformers and OpenAI's reference keep them unrounded), so a gpt-oss file is served as the model it
    was converted from, and any other architecture's as transformers' default (rounded, llama.cpp's)."""
    key = f"{arch}.rope.scaling."
    ext = meta.get(key + "yarn_ext_factor")
    if ext is not None and f32(ext) != 1.0:
        raise InvalidArgument("model", f"{path.name}: {key}yarn_ext_factor {ext} (YaRN's extrapolation mix other "
                                       f"than 1) is not served")
    scaling = {"rope_type": "yarn", "factor": f32(meta[key + "factor"]),
               "original_max_position_embeddings": int(meta[key + "original_context_length"]),
               "beta_fast": f32(meta.get(key + "yarn_beta_fast", 32.0)),
               "beta_slow": f32(meta.get(key + "yarn_beta_slow", 1.0)), "truncate": arch != "gpt-oss"}
    if meta.get(key + "yarn_attn_factor") is not None:
        scaling["attention_factor"] = f32(meta[key + "yarn_attn_factor"])
    return scaling


def f32(value: float) -> float:
    """The shortest decimal naming the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    import numpy as np

    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))
