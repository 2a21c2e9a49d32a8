"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama family's layers with the MLP replaced by
a router and a set of experts, each expert the Llama family's gated MLP (services/worker/models/llama.py).

Per step: the router's softmax (fp32) picks each token's top-k experts, normalised as the model does
(Mixtral always renormalises the k weights; Qwen3-MoE where norm_topk_prob). Then each expert that some
token chose runs once, on all the rows routed to it (its weights read once per step). A token's output
is the sum of its k weighted expert outputs added in ascending expert id (transformers' order), from its
own rows only: the same bits whichever other tokens share its experts (docs/ARCHITECTURE.md rule 4), as
the linear layers give a row the same bits in any batch.

Tensor parallel: every rank holds its columns of every expert (the MLP's split), the router whole.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.ops import Ops
from services.worker.model_config import ModelArchConfig
from services.worker.models.llama import MLP, DecoderLayer, LlamaForCausalLM


class MoE(nn.Module):
    linear_weights = ("router_weight",)
    dense_weights = ("router_weight",)  # kept in the activation dtype under --quantization int8: routing as trained

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable):
        super().__init__()
        self.linear, self.top_k, self.normalize = linear, cfg.experts_per_token, cfg.norm_topk_prob
        self.router_weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.experts = nn.ModuleList(MLP(cfg, ops, linear) for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> weights, experts [T, k]
        probs = torch.softmax(self.linear(x, self.router_weight, None).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        outs = torch.empty(x.shape[0], self.top_k, x.shape[1], dtype=x.dtype, device=x.device)  # [T, k, H]
        for expert in experts.unique().tolist():  # each chosen expert once, over its tokens' rows
            tokens, slots = torch.where(experts == expert)
            outs[tokens, slots] = self.experts[expert](x[tokens]) * weights[tokens, slots, None]
        order = experts.argsort(dim=-1)  # each token's k outputs in ascending expert id
        ordered = outs.gather(1, order[:, :, None].expand_as(outs))
        total = torch.zeros_like(x)
        for slot in range(self.top_k):
            total = total + ordered[:, slot]
        return total


class MoeForCausalLM(LlamaForCausalLM):
    one_call_stack = False  # kernels/csrc/decoder.c runs dense MLPs only

    def make_layer(self, local: ModelArchConfig, index: int) -> nn.Module:
        return DecoderLayer(local, self.ops, self.linear, self.cfg.window(index), mlp=MoE(local, self.ops, self.linear))
