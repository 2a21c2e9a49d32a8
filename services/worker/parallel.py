"""What one rank of a tensor x pipeline parallel worker group holds, and the layouts a model allows.

A group of tensor_parallel_size x pipeline_parallel_size ranks holds one copy of the model.
Global rank = pp_rank * tp_size + tp_rank. Pipeline stage s holds the contiguous layers
[s L / pp, (s + 1) L / pp); stage 0 also holds the embedding, the final norm and the lm_head
(the last stage's output comes back to it), so the logits, the sampling and the answer to the
scheduler stay with global rank 0. Within a stage, tensor rank t holds:
  attention heads [t H / tp, (t + 1) H / tp), and the KV heads they read (replicated where
  tp > num_kv_heads: then tp / num_kv_heads ranks hold each KV head);
  MLP columns [t I / tp, (t + 1) I / tp);
  the row-parallel layers' K groups [t G / tp, (t + 1) G / tp) (kernels/row_parallel.py), and so
  tp must divide G, which bounds the layouts (SmolLM2-135M: G = 3, so tp in {1, 3});
  vocabulary rows [t V / tp, (t + 1) V / tp) of the embedding and the lm_head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kernels.row_parallel import reduction_groups
from services.core.errors import InvalidArgument
from services.worker.model_config import ModelArchConfig


def total_groups(cfg: ModelArchConfig, align: int | tuple[int, int] = 1) -> int:
    """The model's row-parallel K groups (kernels/row_parallel.py), each `align` columns wide."""
    return reduction_groups(cfg.num_heads, cfg.intermediate_size, cfg.head_dim, align)


def check_layout(cfg: ModelArchConfig, tp: int, pp: int, align: int | tuple[int, int] = 1) -> None:
    """InvalidArgument naming the constraint where this model cannot be split so (align: 32 for GGUF
    blocks, whose groups must hold whole blocks)."""
    groups = total_groups(cfg, align)
    if tp < 1:
        raise InvalidArgument("tensor_parallel_size", f"must be at least 1, got {tp}")
    if pp < 1:
        raise InvalidArgument("pipeline_parallel_size", f"must be at least 1, got {pp}")
    if groups % tp:
        raise InvalidArgument("tensor_parallel_size", (
            f"{tp} must divide the model's {groups} row-parallel reduction groups (the largest divisor of "
            f"gcd(num_attention_heads {cfg.num_heads}, intermediate_size {cfg.intermediate_size}) up to 8"
            f"{f' whose groups are whole blocks of {align} columns' if align not in (1, (1, 1)) else ''}); "
            f"this model allows {[d for d in range(1, groups + 1) if groups % d == 0]}"))
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise InvalidArgument("tensor_parallel_size", (
            f"{tp} must divide num_key_value_heads {cfg.num_kv_heads} or be a multiple of it (KV heads are "
            f"split, or replicated evenly)"))
    if pp > cfg.num_layers:
        raise InvalidArgument("pipeline_parallel_size", f"{pp} stages for {cfg.num_layers} layers")


@dataclass(frozen=True, kw_only=True)
class Shard:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    align: int | tuple[int, int] = 1  # K group width multiple (o_proj's, down_proj's): GGUF's block elements

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int, align: int = 1) -> Shard:
        return cls(tp_rank=rank % tp_size, tp_size=tp_size, pp_rank=rank // tp_size, pp_size=pp_size, align=align)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def part(self, total: int, size: int | None = None, rank: int | None = None) -> tuple[int, int]:
        """[start, stop) of this tensor rank's even part of `total` things."""
        size, rank = size or self.tp_size, self.tp_rank if rank is None else rank
        return rank * total // size, (rank + 1) * total // size

    def heads(self, cfg: ModelArchConfig) -> tuple[int, int]:
        return self.part(cfg.num_heads)

    def kv_heads(self, cfg: ModelArchConfig) -> tuple[int, int]:
        if self.tp_size <= cfg.num_kv_heads:
            return self.part(cfg.num_kv_heads)
        first = self.tp_rank * cfg.num_kv_heads // self.tp_size  # replicated: tp / kv ranks share one
        return first, first + 1

    def layers(self, cfg: ModelArchConfig) -> tuple[int, int]:
        return self.part(cfg.num_layers, self.pp_size, self.pp_rank)

    def vocab(self, cfg: ModelArchConfig) -> tuple[int, int]:
        return self.part(cfg.vocab_size)

    def groups(self, cfg: ModelArchConfig) -> tuple[int, int]:
        """This rank's row-parallel groups [g0, g1) of the model's G."""
        return self.part(total_groups(cfg, self.align))

    def local_arch(self, cfg: ModelArchConfig) -> ModelArchConfig:
        """The shapes this rank's modules have: its heads, KV heads, MLP columns and layers."""
        h0, h1 = self.heads(cfg)
        k0, k1 = self.kv_heads(cfg)
        i0, i1 = self.part(cfg.intermediate_size)
        l0, l1 = self.layers(cfg)
        return dataclasses.replace(cfg, num_heads=h1 - h0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0,
                                   num_layers=l1 - l0)

    def slice_for(self, name: str, cfg: ModelArchConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop) of a Hugging Face tensor that this rank loads, or None for all of it.
        The one place that knows how each weight is split (safetensors and GGUF alike)."""
        d = cfg.head_dim
        h0, h1 = self.heads(cfg)
        k0, k1 = self.kv_heads(cfg)
        i0, i1 = self.part(cfg.intermediate_size)
        rows = {"q_proj": (h0 * d, h1 * d), "k_proj": (k0 * d, k1 * d), "v_proj": (k0 * d, k1 * d),
                "gate_proj": (i0, i1), "up_proj": (i0, i1)}
        columns = {"o_proj": (h0 * d, h1 * d), "down_proj": (i0, i1)}
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab(cfg))
        if name.endswith("self_attn.sinks"):  # gpt-oss: one per query head
            return (0, h0, h1)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module in rows:
            return (0, *rows[module])
        if module in columns and name.endswith(".weight"):
            return (1, *columns[module])
        return None

    def holds_layer(self, index: int, cfg: ModelArchConfig) -> bool:
        l0, l1 = self.layers(cfg)
        return l0 <= index < l1
