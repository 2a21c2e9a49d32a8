"""Loading a checkpoint into our model modules: a Hugging Face folder (config.json +
*.safetensors), its linear weights optionally quantized to int8 at load, or the folder's GGUF
file with its quantized blocks kept as they are (kernels/quant.py multiplies them).

quantization (WorkerConfig.quantization):
  auto   gguf where the folder holds a GGUF file (the default model does), else none
  none   the safetensors weights in the activation dtype
  gguf   the GGUF's tensors: rows of blocks byte for byte (every type kernels/quant.py serves: Q4_0,
         Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS), F16/BF16/F32 ones as dense weights; the
         embedding and lm_head as the file has them (token_embd, output); a fused q/k/v or gate/up
         whose parts a llama.cpp mix stores in different types as a quant.QuantParts
  int8   the safetensors weights, every decoder linear layer and the lm_head quantized per
         output channel (the row-parallel o_proj and down_proj per output channel and K group,
         kernels/row_parallel.py, so that a rank of a worker group quantizes what it holds and every
         layout has the same scales); the embedding lookup stays in the checkpoint's precision (a
         tied lm_head is quantized from a copy)

activation_quant (WorkerConfig.activation_quant, resolved by `resolve_activation_quant`): int8 makes
every quantized weight (GGUF or int8, the lm_head included) multiply activations rounded to int8
per block of 32 (kernels/csrc/quant_dot.c: integer dot products, the same bits on every CPU tier);
auto is int8 for a GGUF file holding K-quants (or IQ4_XS), else AUTO_ACTIVATION_QUANT for quantized weights,
and none for dense ones.

A rank of a tensor x pipeline parallel worker group (services/worker/parallel.py, `shard`) reads
only its part of each tensor: safetensors' get_slice, the mapped GGUF file's rows and blocks.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from kernels import quant
from kernels.linear import prepack
from kernels.ops import Ops
from services.core import gguf_file
from services.core.config import AUTO_ACTIVATION_QUANT
from services.core.errors import InvalidArgument
from services.worker.checkpoint_names import LAYER as _LAYER, tensors as _tensors
from services.worker.gguf_weights import find_gguf_file, gguf_arch_of, read_tensors
from services.worker.model_config import ModelArchConfig
from services.worker.models import model_class
from services.worker.models.llama import LlamaForCausalLM
from services.worker.parallel import Shard
from kernels.row_parallel import split_dense

_LAYER_PARAMS = {  # HF name inside a layer -> (our attribute path, part of a fused weight)
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_attn_norm", None),
    "pre_feedforward_layernorm.weight": ("pre_ff_norm", None),  # Gemma's four norms a layer
    "post_feedforward_layernorm.weight": ("post_ff_norm", None),
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
    "mlp.gate.weight": ("mlp.router_weight", None),  # a mixture of experts' router (models/moe.py)
    "self_attn.o_proj.bias": ("attn.o_bias", None),  # gpt-oss (models/gpt_oss.py)
    "self_attn.sinks": ("attn.sinks", None),
    "mlp.router.weight": ("mlp.router_weight", None),
    "mlp.router.bias": ("mlp.router_bias", None),
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
_EXPERT_PARAMS = {"gate_proj": ("gate_up_weight", 0), "up_proj": ("gate_up_weight", 1),
                  "down_proj": ("down_weight", None),  # and gpt-oss's biases:
                  "gate_proj.bias": ("gate_up_bias", 0), "up_proj.bias": ("gate_up_bias", 1),
                  "down_proj.bias": ("down_bias", None)}
_TOP_PARAMS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}


def resolve_dtype(name: str, cfg: ModelArchConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16", "float16") else "float32"
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"  # fp16 matmul is ~1 GFLOP/s on these CPUs
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_quantization(name: str, folder: Path, device_type: str = "cpu", encoder: bool = False) -> str:
    """auto: gguf where the model is a GGUF file or a folder holding one and the worker runs on the CPU (the
    quantized kernels are CPU kernels), else none (a GGUF file's tensors dequantized at load); none for an
    encoder, which is served dense (a GGUF encoder's tensors dequantized at load)."""
    if name == "auto":
        return "gguf" if device_type == "cpu" and not encoder and find_gguf_file(folder) is not None else "none"
    if name == "gguf" and find_gguf_file(folder) is None:
        raise InvalidArgument("quantization", f"gguf: {folder} is no GGUF file and holds none")
    return name


def resolve_activation_quant(name: str, quantization: str, model: Path | None = None) -> str:
    """auto: int8 for the model's GGUF file (quantization gguf; `model` the file or its folder) where it holds a
    super-block type (the K-quants, IQ4_XS: most files people download, llama.cpp's mixes included, and the types
    llama.cpp itself multiplies by 8-bit activations, its Q8_K), else AUTO_ACTIVATION_QUANT for quantized weights;
    none where the weights are not quantized (int8 activations only exist for quantized weights: asking for them
    without is refused)."""
    if quantization == "none":
        if name == "int8":
            raise InvalidArgument("activation_quant", "int8 activations need quantized weights (quantization gguf "
                                                      "or int8)")
        return "none"
    if name != "auto":
        return name
    if quantization == "gguf" and model is not None and holds_super_blocks(find_gguf_file(model)):
        return "int8"
    return AUTO_ACTIVATION_QUANT


def holds_super_blocks(gguf: Path) -> bool:
    """Whether a tensor of the GGUF file is of a super-block type (Q2_K .. Q6_K, IQ4_XS), from its header."""
    return any(code in quant.SUPER_FORMATS for code in gguf_file.tensor_types(gguf).values())


def _int8_activations(model: LlamaForCausalLM) -> None:
    """Every quantized weight of the model (fused, row-parallel groups, the lm_head) takes int8 activations
    (InvalidArgument naming activation_quant where a weight's type does not take them)."""
    try:
        _set_int8_activations(model)
    except ValueError as error:
        raise InvalidArgument("activation_quant", str(error)) from None


def _set_int8_activations(model: LlamaForCausalLM) -> None:
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, (quant.QuantWeight, quant.QuantParts)):
                setattr(module, name, value.with_activations(True))
            elif isinstance(value, tuple) and value and all(isinstance(v, quant.QuantWeight) for v in value):
                setattr(module, name, tuple(v.with_activations(True) for v in value))


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, ops: Ops,
               linear: Callable, quantization: str = "none", shard: Shard | None = None,
               comm=None, activation_quant: str = "none") -> LlamaForCausalLM:
    """The model, or with `shard` this rank's part of it (comm: the worker group's transport);
    activation_quant int8: every quantized weight multiplies int8 activations (kernels/csrc/quant_dot.c)."""
    int8_activations = activation_quant == "int8"
    cfg = ModelArchConfig.from_model(folder)
    shard = shard or Shard(align=gguf_align(quantization, folder))
    model = model_class(cfg.family)(cfg, ops, linear, shard, comm)
    if cfg.is_encoder:  # the BERT family: its own names and layout (services/worker/models/bert.py)
        if quantization not in ("none", "auto"):
            raise InvalidArgument("quantization", f"{quantization}: an encoder is served unquantized (none; a GGUF "
                                                  f"encoder's tensors are dequantized at load)")
        from services.worker.models.bert import load_encoder

        return load_encoder(folder, model, dtype, device, prepack)
    if quantization != "none" and device.type != "cpu":
        raise InvalidArgument("quantization", f"{quantization} runs on the CPU only, not on {device.type}")
    if quantization == "gguf":
        return _load_gguf(model, cfg, find_gguf_file(folder), dtype, device, shard, int8_activations)
    parts: dict[str, dict[int, torch.Tensor]] = {}  # fused weights gathered piece by piece
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tensors = _gguf_dense(folder, cfg, shard) if Path(folder).is_file() else _safetensors(folder, cfg, shard)
    for (path, part), tensor in tensors:
        if part is None:
            _assign(params, path, tensor)
            loaded.add(path)
        else:
            parts.setdefault(path, {})[part] = tensor
    for path, pieces in parts.items():
        _assign(params, path, torch.cat([pieces[i] for i in sorted(pieces)], dim=0))
        loaded.add(path)
    if cfg.tie_word_embeddings and shard.first_stage:
        loaded.add("lm_head")
    _check_complete(params, loaded)
    if not (Path(folder).is_file() and gguf_arch_of(folder).norms_as_served):
        model.finish_load()  # a Gemma GGUF's norms already hold 1 + w
    if quantization == "int8":
        groups = model.groups[1] - model.groups[0]
        for path in _decoder_linear_paths(model):
            weight = params[path].data
            if path.endswith(("o_weight", "down_weight")):  # row-parallel: per K group
                _replace(model, path, tuple(quant.quantize_int8(g, dtype) for g in split_dense(weight, groups)))
            else:
                _replace(model, path, quant.quantize_int8(weight, dtype))
        # the lm_head too (a small model's largest weight: 20% of the default model's bytes, which
        # a decode step streams once); a tied embedding keeps its dense rows for the lookup
        if shard.first_stage:
            _replace(model, "lm_head", quant.quantize_int8(model.lm_head.data, dtype))
    if int8_activations:
        _int8_activations(model)
    model = model.to(device=device, dtype=dtype)
    model.prepack(prepack)
    return model


def _safetensors(folder: Path, cfg: ModelArchConfig, shard: Shard):
    """((target, part), tensor) for each checkpoint tensor this rank holds, its rows or columns only."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InvalidArgument("model", f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name, read in _tensors(reader, cfg):
                target = _target(name, cfg, shard)
                if target is not None:
                    yield target, read(shard.slice_for(name, cfg))


def _gguf_dense(path: Path, cfg: ModelArchConfig, shard: Shard):
    """The same from a GGUF file, every tensor dequantized to float32 by the `gguf` package (quantization
    none: a GGUF on a GPU, or any type the quantized kernels do not serve)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    for tensor in read_tensors(path, cfg.num_heads, cfg.num_kv_heads):
        target = _target(tensor.hf_name, cfg, shard)
        if target is None:
            continue
        values = dequantize(tensor.data, GGMLQuantizationType(tensor.type_id)).astype(np.float32)
        dense = torch.from_numpy(np.ascontiguousarray(values.reshape(tensor.shape)))
        part = shard.slice_for(tensor.hf_name, cfg)
        if part is not None:
            dim, start, stop = part
            dense = dense[start:stop] if dim == 0 else dense[:, start:stop].contiguous()
        yield target, dense


def gguf_align(quantization: str, folder: Path | None = None) -> int | tuple[int, int]:
    """The K group width multiple the row-parallel weights need: none, or for GGUF whole blocks, as
    (o_proj's, down_proj's): the largest block of the file's attn_output and ffn_down types, a mixture's
    experts' ffn_down_exps included (256 for a K-quant; 32 without the file)."""
    if quantization != "gguf":
        return 1
    path = find_gguf_file(folder) if folder is not None else None
    if path is None:
        return quant.BLOCK
    from gguf import GGMLQuantizationType

    widest = {"attn_output": quant.BLOCK, "ffn_down": quant.BLOCK}
    for name, type_id in gguf_file.tensor_types(path).items():  # the header alone, not the gguf package's reader
        kind = name.split(".")[-2].removesuffix("_exps") if name.startswith("blk.") else None
        fmt = _served_format(GGMLQuantizationType(type_id).name)
        if kind in widest and fmt is not None:
            widest[kind] = max(widest[kind], quant.block_elems(fmt))
    return widest["attn_output"], widest["ffn_down"]


def _check_complete(params: dict, loaded: set[str]) -> None:
    missing = sorted(set(params) - loaded)
    if missing:
        raise InvalidArgument("model", f"checkpoint lacks weights for {missing[:5]}")


def _decoder_linear_paths(model: LlamaForCausalLM) -> list[str]:
    """The linear weights of the decoder layers (not the lm_head), as parameter paths."""
    return [f"{prefix}.{name}" for prefix, module in model.named_modules() if prefix.startswith("layers.")
            for name in (*getattr(module, "linear_weights", ()), *getattr(module, "row_parallel_weights", ()))
            if name not in getattr(module, "dense_weights", ())]


def _replace(model: LlamaForCausalLM, path: str, weight: quant.QuantWeight | tuple) -> None:
    """The parameter at `path` becomes a plain attribute holding `weight` (prepack leaves it alone)."""
    prefix, _, name = path.rpartition(".")
    module = model.get_submodule(prefix) if prefix else model
    module._parameters.pop(name, None)
    setattr(module, name, weight)


def _load_gguf(model: LlamaForCausalLM, cfg: ModelArchConfig, path: Path, dtype: torch.dtype,
               device: torch.device, shard: Shard, int8_activations: bool) -> LlamaForCausalLM:
    """Dense tensors into the parameters, quantized ones as QuantWeights (fused ones row-stacked)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    quantized: dict[str, quant.QuantWeight | quant.QuantParts] = {}
    parts: dict[str, dict[int, object]] = {}
    for tensor in read_tensors(path, cfg.num_heads, cfg.num_kv_heads):
        if tensor.hf_name in _GGUF_TOP and not shard.first_stage:
            continue
        path_part = _GGUF_TOP.get(tensor.hf_name) or _target(tensor.hf_name, cfg, shard)
        if path_part is None:
            continue
        target, part = path_part
        value = _gguf_value(_gguf_part(tensor, shard.slice_for(tensor.hf_name, cfg)), dtype)
        if part is not None:
            parts.setdefault(target, {})[part] = value
        elif isinstance(value, quant.QuantWeight):
            quantized[target] = value
        else:
            _assign(params, target, value)
        loaded.add(target)
    for target, pieces in parts.items():
        stacked = _stack([pieces[i] for i in sorted(pieces)], target, dtype)
        if isinstance(stacked, (quant.QuantWeight, quant.QuantParts)):
            quantized[target] = stacked
        else:
            _assign(params, target, stacked)
    if "lm_head" not in loaded and shard.first_stage:  # tied: the lm_head multiplies by the embedding as the file has it
        loaded.add("lm_head")
        if "embed" in quantized:
            quantized["lm_head"] = quantized["embed"]
    _check_complete(params, loaded)
    for target, weight in quantized.items():
        expected = tuple(model.get_parameter(target).shape)
        if tuple(weight.shape) != expected:
            raise InvalidArgument("model", f"GGUF tensor for {target} has shape {tuple(weight.shape)}, "
                                           f"expected {expected}")
    for target, weight in quantized.items():
        _replace(model, target, weight)
    if int8_activations:
        _int8_activations(model)
    model = model.to(device=device, dtype=dtype)
    model.prepack(prepack)
    return model


_GGUF_TOP = {"model.embed_tokens.weight": ("embed", None), "lm_head.weight": ("lm_head", None)}
_GGUF_DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _gguf_part(tensor, part: tuple[int, int, int] | None):
    """This rank's rows, or columns (whole blocks of a quantized tensor), of a GGUF tensor."""
    if part is None:
        return tensor
    import dataclasses

    dim, start, stop = part
    shape = list(tensor.shape)
    shape[dim] = stop - start
    if dim == 0:
        return dataclasses.replace(tensor, shape=tuple(shape), data=tensor.data[start:stop])
    fmt = _served_format(tensor.type_name)
    if fmt is None:  # dense: the `gguf` reader gives F32 and F16 as values, BF16 as raw bytes (2 a value)
        width = tensor.data.shape[-1] // tensor.shape[-1]
        return dataclasses.replace(tensor, shape=tuple(shape), data=tensor.data[:, start * width:stop * width])
    elems = quant.block_elems(fmt)
    if start % elems or stop % elems:
        raise InvalidArgument("tensor_parallel_size", (
            f"{tensor.hf_name}: a rank's columns [{start}, {stop}) are not whole {tensor.type_name} blocks of "
            f"{elems}; choose a layout whose K groups hold whole blocks"))
    width = quant.BLOCK_BYTES[fmt]
    return dataclasses.replace(tensor, shape=tuple(shape),
                               data=tensor.data[:, start // elems * width:stop // elems * width])


def _served_format(type_name: str) -> int | None:
    """kernels/quant.py's format code of a GGUF block type it serves, else None."""
    fmt = quant.FORMATS.get(type_name.lower())
    return fmt if fmt in quant.GGUF_FORMATS else None


SERVED_TYPES = ", ".join([*(quant.NAMES[f].upper() for f in quant.GGUF_FORMATS), "F16", "BF16", "F32"])


def _gguf_value(tensor, dtype: torch.dtype) -> torch.Tensor | quant.QuantWeight:
    fmt = _served_format(tensor.type_name)
    if fmt is not None:
        return quant.from_blocks(tensor.data, fmt, tensor.shape[-1], dtype)
    if tensor.type_name not in _GGUF_DENSE:
        raise InvalidArgument("quantization", f"gguf: tensor {tensor.hf_name} is {tensor.type_name}; served types are "
                                              f"{SERVED_TYPES}")
    import numpy as np

    data = torch.from_numpy(np.array(tensor.data))  # a copy: the mapped file is read-only
    if tensor.type_name == "BF16":
        data = data.view(torch.bfloat16)
    return data.reshape(tensor.shape).to(torch.float32)


def _stack(pieces: list, target: str, dtype: torch.dtype) -> torch.Tensor | quant.QuantWeight | quant.QuantParts:
    """q, k, v (or gate, up) stacked by rows: blocks as they are (one QuantWeight where all share a
    format, else a QuantParts of each part in its own)."""
    if all(isinstance(p, torch.Tensor) for p in pieces):
        return torch.cat(pieces, dim=0)
    if all(isinstance(p, quant.QuantWeight) for p in pieces):
        return quant.stack_parts(pieces, dtype)
    raise InvalidArgument("quantization", f"gguf: the parts of {target} mix quantized and dense tensors; serve it "
                                          f"with --quantization none (the converted folder)")


def _target(name: str, cfg: ModelArchConfig, shard: Shard) -> tuple[str, int | None] | None:
    """Our parameter path (and part of a fused weight) for a checkpoint tensor; None where this rank
    holds none of it (the tied lm_head, another stage's layers, the embedding past stage 0)."""
    if name in _TOP_PARAMS:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        if name != "model.norm.weight" and not shard.first_stage:
            return None
        return _TOP_PARAMS[name], None
    match = _LAYER.match(name)
    expert = _EXPERT.match(match.group(2)) if match else None
    if expert:
        attribute, part = _EXPERT_PARAMS[expert.group(2) if expert.group(3) == "weight" else
                                         f"{expert.group(2)}.bias"]
        index = int(match.group(1))
        if not shard.holds_layer(index, cfg):
            return None
        return f"layers.{index - shard.layers(cfg)[0]}.mlp.experts.{expert.group(1)}.{attribute}", part
    if match and match.group(2) in _LAYER_PARAMS:
        path, part = _LAYER_PARAMS[match.group(2)]
        index = int(match.group(1))
        if not shard.holds_layer(index, cfg):
            return None
        return f"layers.{index - shard.layers(cfg)[0]}.{path}", part
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise InvalidArgument("model", f"unexpected weight {name!r} for a {cfg.model_type} model")


def _assign(params: dict[str, torch.nn.Parameter], path: str, tensor: torch.Tensor) -> None:
    param = params[path]
    if param.shape != tensor.shape:
        raise InvalidArgument("model", f"weight {path} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data = tensor.to(torch.float32) if tensor.dtype == torch.float16 else tensor
