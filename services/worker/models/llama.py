"""The Llama family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm) over a paged cache.

One forward pass runs a flattened batch of tokens with no padding: prefill chunks and
single decode tokens side by side. Kernels come from an `Ops` bundle (PyTorch references
on the CPU, Triton on CUDA); linear layers from `linear_fn` (batch-invariant by default).

In a tensor x pipeline parallel worker group (services/worker/parallel.py) each rank builds the
modules of its shard: its heads, MLP columns, layers and vocabulary rows; `comm` moves the
row-parallel partial sums, the embeddings, the logits and the stages' activations between ranks.
o_proj and down_proj are row-parallel (kernels/row_parallel.py) at every layout, one rank included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kernels.attention import token_layout
from kernels.decoder import LayerWeights, StackShape
from kernels.ops import Ops
from kernels.rotary import cos_sin_cache
from kernels.row_parallel import RowParallelWeight, split_dense, split_quant
from services.worker import pipeline
from services.worker.model_config import ModelArchConfig
from services.worker.parallel import Shard, total_groups


@dataclass(kw_only=True)
class AttentionMetadata:
    """Where each token of the flattened batch sits; built once per step by the runner."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, cache slot for each token's K/V
    block_tables: torch.Tensor  # [S, max_blocks] int64
    seq_lens: torch.Tensor  # [S] context length after this step
    query_start_loc: torch.Tensor  # [S + 1]
    layout: tuple[torch.Tensor, torch.Tensor] | None = None  # kernels.attention.token_layout

    def select(self, s0: int, s1: int) -> AttentionMetadata:
        """Sequences [s0, s1) and their tokens as a batch of their own (a pipeline micro-batch)."""
        if s0 == 0 and s1 == self.seq_lens.shape[0]:
            return self
        t0, t1 = int(self.query_start_loc[s0]), int(self.query_start_loc[s1])
        layout = None if self.layout is None else (self.layout[0][t0:t1] - s0, self.layout[1][t0:t1])
        return AttentionMetadata(positions=self.positions[t0:t1], slot_mapping=self.slot_mapping[t0:t1],
                                 block_tables=self.block_tables[s0:s1], seq_lens=self.seq_lens[s0:s1],
                                 query_start_loc=self.query_start_loc[s0:s1 + 1] - t0, layout=layout)


class Attention(nn.Module):
    linear_weights = ("qkv_weight",)  # multiplied by self.linear; see LlamaForCausalLM.prepack
    row_parallel_weights = ("o_weight",)  # in K groups (kernels/row_parallel.py)
    lora_qkv = lora_o = None  # services/worker/lora.py LoraSite, set by LlamaForCausalLM.enable_lora

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, window: int = 0):
        """window > 0: a sliding-window layer (its keys: the last `window` positions)."""
        super().__init__()
        self.cfg, self.ops, self.linear, self.window = cfg, ops, linear, window
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_weight = nn.Parameter(torch.empty(q_size + 2 * kv_size, cfg.hidden_size), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.empty(q_size + 2 * kv_size), requires_grad=False) if cfg.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(cfg.hidden_size, q_size), requires_grad=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(cfg.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(cfg.head_dim), requires_grad=False)
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rotary_cache: torch.Tensor) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        num_tokens = x.shape[0]
        qkv = self.linear(x, self.qkv_weight, self.qkv_bias)
        if self.lora_qkv is not None:
            qkv = self.lora_qkv.add(qkv, x)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, H, D]
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, KVH, D]
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps)[0]
            k = ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)[0]
        q, k = self.rotate(q, k, meta.positions, rotary_cache)
        k_cache, v_cache = kv_cache
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        window = {"window": self.window} if self.window else {}
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  self.scale, meta.layout, **window)
        out = out.reshape(num_tokens, -1)
        o = self.linear(out, self.o_weight, None)
        return o if self.lora_o is None else self.lora_o.add(o, out)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor):
        """Rotary embedding of each head's first cfg.rotary_dim dims (Phi's partial rotary), all by default."""
        dim = self.cfg.rotary_dim
        if not dim:
            return self.ops.apply_rotary(q, k, positions, rotary_cache)
        q_rot, k_rot = self.ops.apply_rotary(q[..., :dim].contiguous(), k[..., :dim].contiguous(), positions,
                                             rotary_cache)
        return torch.cat([q_rot, q[..., dim:]], -1), torch.cat([k_rot, k[..., dim:]], -1)


class MLP(nn.Module):
    linear_weights = ("gate_up_weight",)
    row_parallel_weights = ("down_weight",)
    lora_gate_up = lora_down = None  # services/worker/lora.py LoraSite (a dense MLP's; never an expert's)

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, activation: Callable | None = None):
        """activation: of the fused [gate, up] product, SiLU-and-multiply by default."""
        super().__init__()
        self.ops, self.linear = ops, linear
        self.activation = activation or ops.silu_and_mul
        self.gate_up_weight = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size),
                                           requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size), requires_grad=False)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:  # [R, 2I] -> [R, I], row by row
        return self.activation(gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.linear(x, self.gate_up_weight, None)
        if self.lora_gate_up is not None:
            gate_up = self.lora_gate_up.add(gate_up, x)
        h = self.activate(gate_up)
        down = self.linear(h, self.down_weight, None)
        return down if self.lora_down is None else self.lora_down.add(down, h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, window: int = 0,
                 mlp: nn.Module | None = None):
        """mlp: the feed-forward block, the gated MLP by default (a mixture of experts: models/moe.py)."""
        super().__init__()
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.attn = Attention(cfg, ops, linear, window)
        self.mlp = mlp if mlp is not None else MLP(cfg, ops, linear)
        self.input_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)

    def forward(self, x, residual, kv_cache, meta, rotary_cache):
        h, residual = self.ops.rms_norm(x, self.input_norm, self.eps, residual)
        if residual is None:  # first layer: the embedding is the residual stream
            residual = x
        h = self.attn(h, kv_cache, meta, rotary_cache)
        h, residual = self.ops.rms_norm(h, self.post_attn_norm, self.eps, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    linear_weights = ("lm_head",)  # a packed copy when tied: the embedding lookup keeps the dense one
    one_call_stack = True  # kernels/csrc/decoder.c runs these layers (Llama-shaped ones only)

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, shard: Shard | None = None, comm=None):
        """cfg: the whole model's; shard: this rank's part (the whole model by default); comm: the worker
        group's transport (services/worker/group.py), None in a single process."""
        super().__init__()
        self.cfg, self.ops, self.linear = cfg, ops, linear
        self.shard, self.comm = shard or Shard(), comm
        self.local = local = self.shard.local_arch(cfg)
        self.groups = self.shard.groups(cfg)  # this rank's row-parallel K groups [g0, g1)
        self.total_groups = total_groups(cfg, self.shard.align)
        v0, v1 = self.shard.vocab(cfg)
        self.vocab_start = v0
        first_layer = self.shard.layers(cfg)[0]
        self.layers = nn.ModuleList(self.make_layer(local, first_layer + i) for i in range(local.num_layers))
        self.final_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        if self.shard.first_stage:  # the embedding and the lm_head live on stage 0
            self.embed = nn.Parameter(torch.empty(v1 - v0, cfg.hidden_size), requires_grad=False)
            self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
                torch.empty(v1 - v0, cfg.hidden_size), requires_grad=False)
        self.stack = None  # kernels.decoder.DecoderStack, set by prepack where the ops have one
        self.lora = None  # services/worker/lora.py LoraState, set by enable_lora
        self.micro_batches = self.shard.pp_size  # a pipelined step's micro-batches (services/worker/pipeline.py)
        rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.register_buffer("rotary_cache", cos_sin_cache(rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                                           cfg.rope_scaling), persistent=False)

    def make_layer(self, local: ModelArchConfig, index: int) -> nn.Module:
        """Decoder layer `index` (the whole model's numbering) with this rank's shapes."""
        return DecoderLayer(local, self.ops, self.linear, self.cfg.window(index))

    def rotary_for(self, layer: nn.Module) -> torch.Tensor:
        """The cos/sin cache a layer rotates by (one for every layer here; Gemma's differ)."""
        return self.rotary_cache

    def finish_load(self) -> None:
        """The loader's last step on the checkpoint's weights, before the dtype cast (nothing here)."""

    def prepack(self, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every weight that only the linear layers read by pack(weight) (kernels.linear.prepack);
        after this the module is no longer moved with .to(). Then take the ops' one-call decoder stack
        where they have one that runs these weights."""
        groups = self.groups[1] - self.groups[0]
        gather = self.comm.gather_partials if self.comm is not None and self.shard.tp_size > 1 else None
        for module in self.modules():
            for name in getattr(module, "linear_weights", ()):
                if name not in module._parameters:  # quantized at load (kernels/quant.py): already packed
                    continue
                weight = module._parameters.pop(name)
                setattr(module, name, pack(weight.data))
            for name in getattr(module, "row_parallel_weights", ()):
                weight = module._parameters.pop(name, None)
                if weight is None:  # quantized at load: as a whole (GGUF) or group by group (int8)
                    value = getattr(module, name)
                    parts = list(value) if isinstance(value, tuple) else split_quant(value, groups)
                else:
                    parts = [pack(part) for part in split_dense(weight.data, groups)]
                setattr(module, name, RowParallelWeight.build(parts, self.total_groups, gather, self.linear))
        llama_shaped = self.one_call_stack and not any(self.cfg.layer_windows) and not self.cfg.rotary_dim
        mlps = [self.stack_mlp(layer) for layer in self.layers] if llama_shaped else [None]
        if self.ops.decoder_stack is not None and all(mlp is not None for mlp in mlps):
            cfg = self.cfg
            layers = [LayerWeights(
                input_norm=layer.input_norm.data, post_attn_norm=layer.post_attn_norm.data, qkv=layer.attn.qkv_weight,
                qkv_bias=_data(layer.attn.qkv_bias), q_norm=_data(getattr(layer.attn, "q_norm", None)),
                k_norm=_data(getattr(layer.attn, "k_norm", None)), o=layer.attn.o_weight, **mlp)
                for layer, mlp in zip(self.layers, mlps)]
            scale = self.layers[0].attn.scale  # the attention's own, not a second formula
            local = self.local
            shape = StackShape(num_heads=local.num_heads, num_kv_heads=local.num_kv_heads, head_dim=cfg.head_dim,
                               eps=cfg.rms_norm_eps, scale=scale, groups=self.total_groups,
                               max_tokens=self.stack_max_tokens())
            self.stack = self.ops.decoder_stack(layers, self.final_norm.data, self.rotary_cache, shape,
                                                gather=self.comm.gather_partials_into if gather else None)

    def stack_mlp(self, layer: nn.Module) -> dict | None:
        """A layer's MLP as kernels/decoder.py's LayerWeights takes it, or None where decoder.c cannot run it."""
        return {"gate_up": layer.mlp.gate_up_weight, "down": layer.mlp.down_weight}

    def stack_max_tokens(self) -> int | None:
        """The most tokens a step may have for decoder.c to run it (more: layer by layer); None: any."""
        return None

    def enable_lora(self, state) -> None:
        """Give every decoder layer's attention and dense MLP its LoRA sites (services/worker/lora.py): a
        step whose batch has adapter rows (state.batch) runs the layers one by one and adds their products."""
        from services.worker.lora import LoraSite

        self.lora = state
        first = self.shard.layers(self.cfg)[0]
        for i, layer in enumerate(self.layers):
            index = first + i
            layer.attn.lora_qkv, layer.attn.lora_o = LoraSite(state, index, "qkv"), LoraSite(state, index, "o")
            if isinstance(layer.mlp, MLP):
                layer.mlp.lora_gate_up, layer.mlp.lora_down = (LoraSite(state, index, "gate_up"),
                                                               LoraSite(state, index, "down"))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor | None:  # [T] -> [T, hidden], final norm applied
        """On stage 0 the last layer's output with the final norm applied; None on the other stages
        (their output went on to the next stage, the last one's back to stage 0), micro-batch by
        micro-batch (services/worker/pipeline.py)."""
        if self.shard.pp_size > 1:
            return pipeline.forward(self, input_ids, kv_caches, meta, self.micro_batches)
        return self.run_layers(self.embed_tokens(input_ids), None, kv_caches, meta, final_norm=True)[0]

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, kv_caches, meta: AttentionMetadata,
                   final_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's layers: (x, residual) in, the final norm applied (residual None) or (x, residual) out."""
        lora_rows = self.lora is not None and self.lora.batch is not None  # the stack has no LoRA sites
        if self.stack is not None and not lora_rows and self.stack.runs(x, kv_caches):  # the same kernels, one call
            layout = meta.layout if meta.layout is not None else token_layout(meta.seq_lens, meta.query_start_loc)
            return self.stack(x, kv_caches, meta.positions, meta.slot_mapping, meta.block_tables, *layout,
                              residual=residual, final_norm=final_norm)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, kv_cache, meta, self.rotary_for(layer))
        if not final_norm:
            return x, residual
        return self.ops.rms_norm(x, self.final_norm, self.cfg.rms_norm_eps, residual)[0], None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.comm is None or self.shard.tp_size == 1:
            return self.embed[input_ids]
        rows = self.embed.shape[0]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < rows)
        x = self.embed[torch.where(mine, local, torch.zeros_like(local))]
        return self.comm.gather_embeddings(x, input_ids)  # each token's row from the rank that holds it

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V] fp32
        logits = self.linear(hidden, self.lm_head, None).float()
        if self.comm is None or self.shard.tp_size == 1:
            return logits
        return self.comm.gather_vocab(logits)  # each rank's vocabulary rows are whole chains: a concatenation


def _data(param: nn.Parameter | None) -> torch.Tensor | None:
    return param.data if param is not None else None

