"""Loading a Hugging Face checkpoint (config.json + *.safetensors) into our model modules."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from kernels.linear import prepack
from kernels.ops import Ops
from services.core.errors import InvalidArgument
from services.worker.model_config import ModelArchConfig
from services.worker.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_PARAMS = {  # HF name inside a layer -> (our attribute path, part of a fused weight)
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_attn_norm", None),
    "self_attn.q_proj.weight": ("attn.qkv_weight", 0),
    "self_attn.k_proj.weight": ("attn.qkv_weight", 1),
    "self_attn.v_proj.weight": ("attn.qkv_weight", 2),
    "self_attn.q_proj.bias": ("attn.qkv_bias", 0),
    "self_attn.k_proj.bias": ("attn.qkv_bias", 1),
    "self_attn.v_proj.bias": ("attn.qkv_bias", 2),
    "self_attn.o_proj.weight": ("attn.o_weight", None),
    "self_attn.q_norm.weight": ("attn.q_norm", None),
    "self_attn.k_norm.weight": ("attn.k_norm", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_weight", 1),
    "mlp.down_proj.weight": ("mlp.down_weight", None),
}
_TOP_PARAMS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}


def resolve_dtype(name: str, cfg: ModelArchConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16", "float16") else "float32"
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"  # fp16 matmul is ~1 GFLOP/s on these CPUs
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, ops: Ops,
               linear: Callable) -> LlamaForCausalLM:
    cfg = ModelArchConfig.from_folder(folder)
    model = LlamaForCausalLM(cfg, ops, linear)
    parts: dict[str, dict[int, torch.Tensor]] = {}  # fused weights gathered piece by piece
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InvalidArgument("model", f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                target = _target(name, cfg)
                if target is None:
                    continue
                path, part = target
                tensor = reader.get_tensor(name)
                if part is None:
                    _assign(params, path, tensor)
                    loaded.add(path)
                else:
                    parts.setdefault(path, {})[part] = tensor
    for path, pieces in parts.items():
        _assign(params, path, torch.cat([pieces[i] for i in sorted(pieces)], dim=0))
        loaded.add(path)
    if cfg.tie_word_embeddings:
        loaded.add("lm_head")
    missing = sorted(set(params) - loaded)
    if missing:
        raise InvalidArgument("model", f"checkpoint lacks weights for {missing[:5]}")
    model = model.to(device=device, dtype=dtype)
    model.prepack(prepack)
    return model


def _target(name: str, cfg: ModelArchConfig) -> tuple[str, int | None] | None:
    if name in _TOP_PARAMS:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        return _TOP_PARAMS[name], None
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_PARAMS:
        path, part = _LAYER_PARAMS[match.group(2)]
        return f"layers.{match.group(1)}.{path}", part
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise InvalidArgument("model", f"unexpected weight {name!r} for a {cfg.model_type} model")


def _assign(params: dict[str, torch.nn.Parameter], path: str, tensor: torch.Tensor) -> None:
    param = params[path]
    if param.shape != tensor.shape:
        raise InvalidArgument("model", f"weight {path} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data = tensor.to(torch.float32) if tensor.dtype == torch.float16 else tensor
