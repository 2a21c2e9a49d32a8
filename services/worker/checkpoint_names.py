"""A checkpoint's tensors under the names the loader maps (services/worker/loader.py `_target`): fused
projections (Phi-3's qkv_proj and gate_up_proj), transformers 5's stacked experts and Mixtral's
block_sparse_moe as the unfused, per-expert tensors of the other checkpoints, each read lazily so that a
rank takes only its part (services/worker/parallel.py `Shard.slice_for`)."""
from __future__ import annotations

import re

import torch

from services.core.errors import InvalidArgument
from services.worker.model_config import ModelArchConfig

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # block_sparse_moe.experts.E.wN

FUSED = {  # a checkpoint's fused projection -> the projections it stacks by rows (Phi-3)
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def tensors(reader, cfg: ModelArchConfig):
    """(HF name, read(part)) for each tensor of a safetensors file; a fused projection as its pieces under
    the unfused names, so that a rank's rows of each piece are taken as for an unfused checkpoint."""
    for name in reader.keys():
        match = LAYER.match(name)
        if match is not None and cfg.model_type == "gpt_oss" and match.group(2) in _GPT_OSS_EXPERTS:
            yield from _gpt_oss_pieces(name, match.group(2), reader.get_tensor(name))
            continue
        if match is not None and cfg.model_type == "gpt_oss" and match.group(2) in _GPT_OSS_MXFP4:
            if match.group(2).endswith("_blocks"):  # with its _scales: dequantized here, [E, in, out] as above
                inner = match.group(2).removesuffix("_blocks")
                whole = dequantize_mxfp4(reader.get_tensor(name), reader.get_tensor(name.removesuffix("_blocks") +
                                                                                     "_scales"))
                yield from _gpt_oss_pieces(name.removesuffix("_blocks"), inner, whole.transpose(1, 2))
            continue
        if match is not None and match.group(2) in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            yield from _expert_pieces(name, match.group(2), reader.get_tensor(name))
            continue
        if match is None or match.group(2) not in FUSED:
            hf_name = _mixtral_name(name)
            yield hf_name, lambda part, name=name: _read(reader, name, part)
            continue
        prefix, pieces = name[:-len(match.group(2))], FUSED[match.group(2)]
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        rows = (q, kv, kv) if len(pieces) == 3 else (cfg.intermediate_size,) * 2
        whole = reader.get_tensor(name)
        if whole.shape[0] != sum(rows):
            raise InvalidArgument("model", f"weight {name} has {whole.shape[0]} rows, expected {sum(rows)}")
        for piece, tensor in zip(pieces, whole.split(rows)):
            yield prefix + piece, lambda part, tensor=tensor: _rows(tensor, part)


def _expert_pieces(name: str, inner: str, whole: torch.Tensor):
    """transformers 5's stacked experts ([E, 2I, H] gate_up, [E, H, I] down) as per-expert tensors under the
    per-expert names checkpoints on the Hub use, so that a rank's part of each is taken as for those."""
    prefix = name[:-len(inner)] + "mlp.experts."
    for expert, tensor in enumerate(whole):
        if inner.endswith("down_proj"):
            yield f"{prefix}{expert}.down_proj.weight", lambda part, tensor=tensor: _rows(tensor, part)
            continue
        gate, up = tensor.chunk(2)
        yield f"{prefix}{expert}.gate_proj.weight", lambda part, gate=gate: _rows(gate, part)
        yield f"{prefix}{expert}.up_proj.weight", lambda part, up=up: _rows(up, part)


_GPT_OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
                    "mlp.experts.down_proj_bias")


_GPT_OSS_MXFP4 = tuple(f"mlp.experts.{p}_{part}" for p in ("gate_up_proj", "down_proj")
                       for part in ("blocks", "scales"))
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 experts as its checkpoints store them: blocks [..., G, 16] uint8 (32 FP4 E2M1 values a
    block, element 2j in byte j's low nibble, 2j + 1 in its high one), scales [..., G] uint8 (E8M0: 2 **
    (s - 127)) -> [..., G * 32] float32. Exact: every value is a power of two times an FP4 value."""
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _gpt_oss_pieces(name: str, inner: str, whole: torch.Tensor):
    """gpt-oss's stacked experts, stored input-major ([E, H, 2I] gate_up with gate and up interleaved by
    column, [E, I, H] down) with [E, 2I] and [E, H] biases, as per-expert tensors under the per-expert
    names (gate_proj, up_proj, down_proj .weight/.bias, [out, in] as the other checkpoints)."""
    prefix = name[:-len(inner)] + "mlp.experts."
    for expert, tensor in enumerate(whole):
        if inner.endswith("down_proj"):
            yield f"{prefix}{expert}.down_proj.weight", lambda part, t=tensor: _rows(t.t().contiguous(), part)
        elif inner.endswith("down_proj_bias"):
            yield f"{prefix}{expert}.down_proj.bias", lambda part, t=tensor: t
        else:
            kind = "bias" if inner.endswith("_bias") else "weight"
            gate, up = tensor[..., ::2], tensor[..., 1::2]
            if kind == "weight":
                gate, up = gate.t(), up.t()
            yield f"{prefix}{expert}.gate_proj.{kind}", lambda part, g=gate: _rows(g.contiguous(), part)
            yield f"{prefix}{expert}.up_proj.{kind}", lambda part, u=up: _rows(u.contiguous(), part)


def _mixtral_name(name: str) -> str:
    """Mixtral's block_sparse_moe.{gate, experts.E.w1/w2/w3} under the names of the other mixtures."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, _, tail = name.rpartition(".experts.")
    if not head:
        return name
    expert, w, rest = tail.split(".", 2)
    return f"{head}.experts.{expert}.{_MIXTRAL_NAMES.get(w, w)}.{rest}"


def _rows(tensor: torch.Tensor, part: tuple[int, int, int] | None) -> torch.Tensor:
    if part is None:
        return tensor
    dim, start, stop = part
    return tensor[start:stop] if dim == 0 else tensor[:, start:stop]


def _read(reader, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """A safetensors tensor, or only this rank's rows or columns of it."""
    if part is None:
        return reader.get_tensor(name)
    dim, start, stop = part
    sliced = reader.get_slice(name)
    return sliced[start:stop] if dim == 0 else sliced[:, start:stop]
