"""gpt-oss over the paged cache: the mixture-of-experts decoder (services/worker/models/moe.py) as
OpenAI's gpt-oss arranges it.

What differs, and where:
- attention: q/k/v and o biases; a learned sink logit per query head in each head's softmax
  denominator (kernels/attention.py `sinks`, the C and Triton kernels alike); layers alternate
  sliding-window and full attention (`cfg.layer_windows`); YaRN rope (kernels/rotary.py);
- the router: a linear layer with a bias, the top-k of its logits, a softmax over those k only;
- each expert: [gate, up] with biases, the clamped SwiGLU (gate clamped above at `swiglu_limit`, up
  to +-limit, out = (up + 1) * gate * sigmoid(alpha * gate)), down with a bias.
Experts run grouped and are summed in ascending expert id as in moe.py (batch invariant); the
activation and the down biases over every row of the step at once.
A checkpoint's stacked, interleaved experts are split per expert at load (checkpoint_names.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.ops import Ops
from services.worker.model_config import ModelArchConfig
from services.worker.models.llama import MLP, Attention, DecoderLayer
from services.worker.models.moe import MoE, MoeForCausalLM


class SinkAttention(Attention):
    """The Llama family's attention with an o_proj bias and a sink logit per query head (this rank's)."""

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, window: int = 0):
        super().__init__(cfg, ops, linear, window)
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False)

    def forward(self, x, kv_cache, meta, rotary_cache):
        cfg, ops = self.cfg, self.ops
        num_tokens = x.shape[0]
        q, k, v = self.linear(x, self.qkv_weight, self.qkv_bias).split(self.split, dim=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotate(q, k, meta.positions, rotary_cache)
        k_cache, v_cache = kv_cache
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        window = {"window": self.window} if self.window else {}
        out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  self.scale, meta.layout, sinks=self.sinks.float(), **window)
        # o_proj is row-parallel (its K groups folded in one order at every layout): the bias after the fold
        return self.linear(out.reshape(num_tokens, -1), self.o_weight, None) + self.o_bias


class ClampedSwiGLUExpert(MLP):
    """One expert: gate_up_weight stacks [gate; up] rows (the checkpoint interleaves them; split at load)."""

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable):
        super().__init__(cfg, ops, linear)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_bias = nn.Parameter(torch.empty(2 * cfg.intermediate_size), requires_grad=False)
        self.down_bias = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:  # [R, 2I] -> [R, I], element by element
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.activate(self.linear(x, self.gate_up_weight, self.gate_up_bias))
        return self.linear(hidden, self.down_weight, None) + self.down_bias


class GptOssMoE(MoE):
    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable):
        nn.Module.__init__(self)
        self.linear, self.top_k = linear, cfg.experts_per_token
        self.router_weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.router_bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
        self.experts = nn.ModuleList(ClampedSwiGLUExpert(cfg, ops, linear) for _ in range(cfg.num_experts))
        self._down_biases = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> weights, experts [T, k]
        logits = self.linear(x, self.router_weight, self.router_bias).float()
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), experts


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, window: int):
        super().__init__(cfg, ops, linear, window, mlp=GptOssMoE(cfg, ops, linear))
        self.attn = SinkAttention(cfg, ops, linear, window)


class GptOssForCausalLM(MoeForCausalLM):
    def make_layer(self, local: ModelArchConfig, index: int) -> nn.Module:
        return GptOssDecoderLayer(local, self.ops, self.linear, self.cfg.window(index))
