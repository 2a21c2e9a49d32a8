"""Gemma 3 (text) over the paged cache: the Llama family's attention and MLP, arranged as Gemma does.

What differs from services/worker/models/llama.py, and where:
- layers alternate sliding-window (local) and global attention (`cfg.layer_windows`); a local
  layer's paged attention reads only its last `window` keys and rotates by its own rope base
  (`cfg.local_rope_theta`), a global one by `cfg.rope_theta` (and its scaling);
- four norms a layer: the attention's and the MLP's outputs are normed before the residual add,
  their inputs as usual; RMSNorm scales by (1 + w), folded into the weights at load (finish_load);
- per-head q/k norms, the attention scale query_pre_attn_scalar ** -0.5 (`cfg.attn_scale`);
- a GELU-tanh gated MLP, the embedding scaled by sqrt(hidden_size), and Gemma 2/3's optional
  final logit soft-cap.
The one-call decoder stack (kernels/csrc/decoder.c) runs Llama-shaped layers only: these run
layer by layer through the ops (the same kernels, one call each).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.ops import Ops
from kernels.rotary import cos_sin_cache
from services.worker.model_config import ModelArchConfig
from services.worker.models.llama import MLP, Attention, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, window: int):
        super().__init__()
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.attn = Attention(cfg, ops, linear, window)
        self.mlp = MLP(cfg, ops, linear, activation=ops.gelu_tanh_and_mul)
        for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm"):
            setattr(self, name, nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False))

    def forward(self, x, residual, kv_cache, meta, rotary_cache):
        rms_norm, eps = self.ops.rms_norm, self.eps
        h, residual = rms_norm(x, self.input_norm, eps, residual)
        if residual is None:  # first layer: the scaled embedding is the residual stream
            residual = x
        h = rms_norm(self.attn(h, kv_cache, meta, rotary_cache), self.post_attn_norm, eps)[0]
        h, residual = rms_norm(h, self.pre_ff_norm, eps, residual)
        return rms_norm(self.mlp(h), self.post_ff_norm, eps)[0], residual


class GemmaForCausalLM(LlamaForCausalLM):
    one_call_stack = False

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable, shard=None, comm=None):
        super().__init__(cfg, ops, linear, shard, comm)
        self.register_buffer("rotary_local", cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                                           cfg.local_rope_theta or cfg.rope_theta), persistent=False)
        # transformers multiplies by sqrt(hidden) held in fp32 and cast to the embedding's dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32))

    def make_layer(self, local: ModelArchConfig, index: int) -> nn.Module:
        return GemmaDecoderLayer(local, self.ops, self.linear, self.cfg.window(index))

    def rotary_for(self, layer: nn.Module) -> torch.Tensor:
        return self.rotary_local if layer.attn.window else self.rotary_cache

    def finish_load(self) -> None:
        """Gemma's RMSNorm multiplies by (1 + w): every norm weight gets its 1 here, in the checkpoint's
        precision before the cast (fp32 bits equal transformers'; bf16 rounds 1 + w once). A GGUF file's
        Gemma norms already hold 1 + w (llama.cpp's converter adds it): its loading must not call this."""
        for name, param in self.named_parameters():
            if name.endswith("norm"):
                param.data = param.data.float() + 1.0

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
