"""The architecture facts the worker needs, read from a Hugging Face config.json or a GGUF file's metadata."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.core.errors import InvalidArgument

# model_type -> (model family: services/worker/models/, q/k/v projections have a bias, per-head q/k RMSNorm)
SUPPORTED = {
    "llama": ("llama", False, False),
    "mistral": ("llama", False, False),
    "qwen2": ("llama", True, False),
    "qwen3": ("llama", False, True),
    "phi3": ("llama", False, False),  # fused qkv_proj and gate_up_proj (loader.py), partial rotary, LongRoPE
    "gemma3_text": ("gemma", False, True),
    "qwen3_moe": ("moe", False, True),  # services/worker/models/moe.py
    "mixtral": ("moe", False, False),
    "gpt_oss": ("gpt_oss", True, False),  # services/worker/models/gpt_oss.py
    "bert": ("bert", True, False),  # an encoder (services/worker/models/bert.py): embed or score only
    "xlm-roberta": ("bert", True, False),
}
_WINDOWED = ("mistral", "phi3", "mixtral")  # every layer attends within config.sliding_window where it is set


@dataclass(frozen=True, kw_only=True)
class ModelArchConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    family: str = "llama"  # the model class (services/worker/models/__init__.py)
    # Gemma 3 (services/worker/models/gemma.py); the defaults are the Llama family's
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 for global attention; () all global
    local_rope_theta: float | None = None  # the sliding layers' rope base
    attn_scale: float | None = None  # query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    rotary_dim: int = 0  # the leading dims of each head that rotate (Phi's partial rotary); 0: all head_dim
    # mixtures of experts (intermediate_size is then each expert's)
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to 1 (Mixtral always)
    # gpt-oss's experts: the clamped SwiGLU's constants
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # encoders (BERT family; rms_norm_eps holds their LayerNorm's eps)
    type_vocab_size: int = 0
    position_offset: int = 0  # XLM-RoBERTa's positions start after its padding id (pad_token_id + 1)
    num_labels: int = 0  # a sequence-classification head's outputs (a cross-encoder's score); 0: none

    @property
    def is_encoder(self) -> bool:
        return self.family == "bert"

    def window(self, layer: int) -> int:
        """Layer `layer`'s (the whole model's index) sliding window; 0: it attends to every key."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_model(cls, model: str | Path) -> ModelArchConfig:
        """A model folder's config.json, or a GGUF file's metadata (services/worker/gguf_arch.py)."""
        if Path(model).is_file():
            from services.worker.gguf_arch import config_dict

            return cls.from_dict(config_dict(model))
        return cls.from_folder(model)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelArchConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise InvalidArgument("model", f"no config.json in {folder}")
        raw = json.loads(path.read_text())
        return cls.from_dict(raw, _generation_eos(Path(folder)))

    @classmethod
    def from_dict(cls, raw: dict, extra_eos: tuple[int, ...] = ()) -> ModelArchConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED:
            raise InvalidArgument("model_type", f"unsupported architecture {model_type!r}; "
                                                f"supported: {sorted(SUPPORTED)}")
        family, qkv_bias, qk_norm = SUPPORTED[model_type]
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        extra = _gemma_fields(raw) if family == "gemma" else {}
        if family == "gemma":
            rope_theta, scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        elif model_type in _WINDOWED and raw.get("sliding_window"):
            extra["layer_windows"] = (raw["sliding_window"],) * raw["num_hidden_layers"]
        scaling = _longrope(raw, scaling)
        if family == "moe":
            extra.update(_moe_fields(raw))
        if family == "gpt_oss":
            extra.update(_gpt_oss_fields(raw))
        max_len = raw.get("max_position_embeddings", 2048)
        if family == "bert":
            extra.update(_encoder_fields(raw))
            max_len = extra.pop("max_position_embeddings")
        partial = raw.get("partial_rotary_factor") or (scaling or {}).get("partial_rotary_factor", 1.0)
        return cls(
            family=family,
            **extra,
            model_type=model_type,
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps") or raw.get("layer_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=max_len,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=raw.get("attention_bias", qkv_bias),
            qk_norm=qk_norm,
            eos_token_ids=tuple(dict.fromkeys(eos_ids + extra_eos)),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
        )


def _generation_eos(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def _gemma_fields(raw: dict) -> dict:
    """Gemma 3's per-layer windows and rope bases, its attention scale and logit cap (config.json as
    transformers 4 and 5 write it)."""
    if raw.get("attn_logit_softcapping") is not None:
        raise InvalidArgument("model", "attn_logit_softcapping (Gemma 2's attention soft-cap) is not served")
    num_layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % raw.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(num_layers)]
    window = raw.get("sliding_window") or 0
    params = raw.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    scaling = raw.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    return dict(
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        local_rope_theta=float(local.get("rope_theta") or raw.get("rope_local_base_freq", 10000.0)),
        rope_theta=float(full.get("rope_theta") or raw.get("rope_theta", 1000000.0)),
        rope_scaling=scaling,
        attn_scale=float(raw.get("query_pre_attn_scalar") or raw.get("head_dim", 256)) ** -0.5,
        final_logit_softcap=raw.get("final_logit_softcapping"),
    )


def _longrope(raw: dict, scaling: dict | None) -> dict | None:
    """Phi-3's LongRoPE ("su" in older configs) with what kernels/rotary.py needs in one dict: the
    short and long factors, the pre-training context and the attention factor's inputs."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return scaling
    original = scaling.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
    return dict(scaling, rope_type="longrope", original_max_position_embeddings=original,
                max_position_embeddings=raw.get("max_position_embeddings", original))


def _moe_fields(raw: dict) -> dict:
    """The experts of Qwen3-MoE (num_experts, norm_topk_prob) or Mixtral (num_local_experts, renormalised)."""
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise InvalidArgument("model", "dense layers among the expert layers (mlp_only_layers, decoder_sparse_step) "
                                       "are not served")
    return dict(num_experts=raw.get("num_experts") or raw["num_local_experts"],
                experts_per_token=raw["num_experts_per_tok"],
                norm_topk_prob=raw.get("model_type") == "mixtral" or raw.get("norm_topk_prob", False))


def _gpt_oss_fields(raw: dict) -> dict:
    """gpt-oss: its sliding and full layers, its experts (the top-k logits' softmax: no renormalising
    field), the clamped SwiGLU's constants."""
    num_layers, window = raw["num_hidden_layers"], raw.get("sliding_window") or 0
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(num_layers)]
    return dict(layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                num_experts=raw["num_local_experts"],
                experts_per_token=raw.get("num_experts_per_tok") or raw["experts_per_token"],  # the latter: OpenAI's
                swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), swiglu_limit=float(raw.get("swiglu_limit", 7.0)))


def _encoder_fields(raw: dict) -> dict:
    """BERT / XLM-RoBERTa: token types, where positions start, the classification head's size."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise InvalidArgument("model", f"hidden_act {raw['hidden_act']!r}: encoders are served with gelu only")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise InvalidArgument("model", "only absolute position embeddings are served for encoders")
    is_classifier = any(a.endswith("ForSequenceClassification") for a in raw.get("architectures") or ())
    offset = raw.get("pad_token_id", 1) + 1 if raw["model_type"] == "xlm-roberta" else 0
    return dict(type_vocab_size=raw.get("type_vocab_size", 2), position_offset=offset,
                num_labels=len(raw.get("id2label") or {}) or raw.get("num_labels", 1) if is_classifier else 0,
                max_position_embeddings=raw.get("max_position_embeddings", 512) - offset)
