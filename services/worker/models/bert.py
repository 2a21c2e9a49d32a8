"""The BERT family of encoders (BERT, XLM-RoBERTa: BGE, E5, GTE, multilingual-e5, bge-reranker).

An encoder sees every token of its sequence at once (non-causal attention), so a sequence runs
whole in one step: the scheduler never chunks it and keeps no prefix cache for it
(WorkerInfo.pooling_whole), and nothing is written to the KV cache. Absolute position embeddings
(XLM-RoBERTa's start after its padding id: `position_offset`), token type embeddings, post-LN,
GELU (erf). The same flattened batch with no padding as the decoders: each sequence's attention is
computed on its own rows, and the linear layers are the batch-invariant ones (`linear_fn`), so a
sequence's bits do not depend on its neighbours (rule 4).

Token types: 0 up to and including the first separator token, 1 after it (a cross-encoder's
"[CLS] query [SEP] document [SEP]"); a model with one token type (XLM-RoBERTa) has only 0.

`pool_head` is the sequence-classification head (BertForSequenceClassification's pooler and
classifier, or RoBERTa's dense + out_proj) over the first token: a cross-encoder's score.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from services.core.errors import InvalidArgument
from services.worker.model_config import ModelArchConfig
from services.worker.models.llama import AttentionMetadata

_PREFIXES = ("bert.", "roberta.", "model.")  # a classification checkpoint's encoder, or a bare one


class EncoderLayer(nn.Module):
    linear_weights = ("qkv_weight", "o_weight", "up_weight", "down_weight")

    def __init__(self, cfg: ModelArchConfig, linear: Callable):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.cfg, self.linear = cfg, linear
        self.qkv_weight = nn.Parameter(torch.empty(3 * h, h), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.empty(3 * h), requires_grad=False)
        self.o_weight = nn.Parameter(torch.empty(h, h), requires_grad=False)
        self.o_bias = nn.Parameter(torch.empty(h), requires_grad=False)
        self.attn_norm_weight = nn.Parameter(torch.empty(h), requires_grad=False)
        self.attn_norm_bias = nn.Parameter(torch.empty(h), requires_grad=False)
        self.up_weight = nn.Parameter(torch.empty(i, h), requires_grad=False)
        self.up_bias = nn.Parameter(torch.empty(i), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(h, i), requires_grad=False)
        self.down_bias = nn.Parameter(torch.empty(h), requires_grad=False)
        self.out_norm_weight = nn.Parameter(torch.empty(h), requires_grad=False)
        self.out_norm_bias = nn.Parameter(torch.empty(h), requires_grad=False)

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:  # [T, H] -> [T, H]
        cfg = self.cfg
        qkv = self.linear(x, self.qkv_weight, self.qkv_bias)
        attn = torch.empty_like(x)
        for s0, s1 in zip(starts, starts[1:]):  # each sequence on its own: its bits are its own
            q, k, v = qkv[s0:s1].reshape(s1 - s0, 3, cfg.num_heads, cfg.head_dim).permute(1, 2, 0, 3)  # [H, L, D]
            scores = torch.matmul(q, k.transpose(-1, -2)) * cfg.head_dim ** -0.5  # [H, L, L]
            out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)  # [H, L, D]
            attn[s0:s1] = out.transpose(0, 1).reshape(s1 - s0, -1)
        x = _layer_norm(self.linear(attn, self.o_weight, self.o_bias) + x, self.attn_norm_weight,
                        self.attn_norm_bias, cfg.rms_norm_eps)
        up = F.gelu(self.linear(x, self.up_weight, self.up_bias))
        return _layer_norm(self.linear(up, self.down_weight, self.down_bias) + x, self.out_norm_weight,
                           self.out_norm_bias, cfg.rms_norm_eps)


class BertModel(nn.Module):
    """An encoder over the runner's flattened batch: forward gives the last layer's hidden states."""

    linear_weights = ("head_dense", "head_out")
    encoder = True  # non-causal: a sequence runs whole (no chunks, no prefix cache, no KV cache)

    def __init__(self, cfg: ModelArchConfig, ops, linear: Callable, shard=None, comm=None):
        super().__init__()
        if shard is not None and shard.world_size > 1:
            raise InvalidArgument("tensor_parallel_size", "an encoder (BERT family) runs in one process")
        self.cfg, self.ops, self.linear = cfg, ops, linear
        h = cfg.hidden_size
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, h), requires_grad=False)
        self.position_embed = nn.Parameter(torch.empty(cfg.max_position_embeddings + cfg.position_offset, h),
                                           requires_grad=False)
        self.type_embed = nn.Parameter(torch.empty(max(cfg.type_vocab_size, 1), h), requires_grad=False)
        self.embed_norm_weight = nn.Parameter(torch.empty(h), requires_grad=False)
        self.embed_norm_bias = nn.Parameter(torch.empty(h), requires_grad=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg, linear) for _ in range(cfg.num_layers))
        # the classification head (score): dense + tanh over the first token, then [labels, H]
        self.head_dense = self.head_dense_bias = self.head_out = self.head_out_bias = None
        if cfg.num_labels:
            self.head_dense = nn.Parameter(torch.empty(h, h), requires_grad=False)
            self.head_dense_bias = nn.Parameter(torch.empty(h), requires_grad=False)
            self.head_out = nn.Parameter(torch.empty(cfg.num_labels, h), requires_grad=False)
            self.head_out_bias = nn.Parameter(torch.empty(cfg.num_labels), requires_grad=False)
        self.sep_token_id: int | None = None  # set by the loader from the tokenizer: where token type 1 starts
        self.micro_batches = 1

    def prepack(self, pack: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for module in self.modules():
            for name in getattr(module, "linear_weights", ()):
                weight = module._parameters.get(name)
                if weight is not None:
                    del module._parameters[name]
                    setattr(module, name, pack(weight.data))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        starts = meta.query_start_loc.tolist()
        positions = meta.positions + self.cfg.position_offset
        x = self.embed[input_ids] + self.type_embed[self.token_types(input_ids, starts)] + \
            self.position_embed[positions]
        x = _layer_norm(x, self.embed_norm_weight, self.embed_norm_bias, self.cfg.rms_norm_eps)
        for layer in self.layers:
            x = layer(x, starts)
        return x

    def token_types(self, input_ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """0 up to and including each sequence's first separator, 1 after it (one type: all 0)."""
        types = torch.zeros_like(input_ids)
        if self.cfg.type_vocab_size < 2 or self.sep_token_id is None:
            return types
        is_sep = (input_ids == self.sep_token_id).to(torch.int64)
        for s0, s1 in zip(starts, starts[1:]):
            seen = torch.cumsum(is_sep[s0:s1], 0) - is_sep[s0:s1]  # separators strictly before each token
            types[s0:s1] = (seen > 0).to(torch.int64)
        return types

    @torch.inference_mode()
    def classify(self, first: torch.Tensor) -> torch.Tensor:  # [R, H] first tokens -> [R, labels] fp32
        if self.head_out is None:
            raise InvalidArgument("task", "this encoder has no classification head (score needs "
                                          "*ForSequenceClassification)")
        h = torch.tanh(self.linear(first, self.head_dense, self.head_dense_bias))
        return self.linear(h, self.head_out, self.head_out_bias).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise InvalidArgument("task", "an encoder generates no tokens; serve it with --task embed or score")


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row over the last dim (each row's reduction is its own: batch-invariant)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# HF name inside an encoder layer -> (our attribute, part of a fused weight)
_LAYER_NAMES = {
    "attention.self.query.weight": ("qkv_weight", 0), "attention.self.key.weight": ("qkv_weight", 1),
    "attention.self.value.weight": ("qkv_weight", 2), "attention.self.query.bias": ("qkv_bias", 0),
    "attention.self.key.bias": ("qkv_bias", 1), "attention.self.value.bias": ("qkv_bias", 2),
    "attention.output.dense.weight": ("o_weight", None), "attention.output.dense.bias": ("o_bias", None),
    "attention.output.LayerNorm.weight": ("attn_norm_weight", None),
    "attention.output.LayerNorm.bias": ("attn_norm_bias", None),
    "intermediate.dense.weight": ("up_weight", None), "intermediate.dense.bias": ("up_bias", None),
    "output.dense.weight": ("down_weight", None), "output.dense.bias": ("down_bias", None),
    "output.LayerNorm.weight": ("out_norm_weight", None), "output.LayerNorm.bias": ("out_norm_bias", None),
}
_TOP_NAMES = {
    "embeddings.word_embeddings.weight": "embed", "embeddings.position_embeddings.weight": "position_embed",
    "embeddings.token_type_embeddings.weight": "type_embed", "embeddings.LayerNorm.weight": "embed_norm_weight",
    "embeddings.LayerNorm.bias": "embed_norm_bias",
    # BERT's classification head: the pooler, then the classifier
    "pooler.dense.weight": "head_dense", "pooler.dense.bias": "head_dense_bias",
    "classifier.weight": "head_out", "classifier.bias": "head_out_bias",
    # RoBERTa's: classifier.dense, then classifier.out_proj
    "classifier.dense.weight": "head_dense", "classifier.dense.bias": "head_dense_bias",
    "classifier.out_proj.weight": "head_out", "classifier.out_proj.bias": "head_out_bias",
}
_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids")


def _our_name(name: str, cfg: ModelArchConfig) -> tuple[str, int | None] | None:
    for prefix in _PREFIXES:
        if name.startswith(prefix) and not name.startswith(prefix + "classifier"):
            name = name[len(prefix):]
            break
    if name.endswith(_IGNORED):
        return None
    if name.startswith("pooler.") and not cfg.num_labels:
        return None  # an embedding model's pooler is not used (sentence-transformers pools itself)
    if name in _TOP_NAMES:
        return _TOP_NAMES[name], None
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[3] in _LAYER_NAMES:
        attribute, part = _LAYER_NAMES[parts[3]]
        return f"layers.{parts[2]}.{attribute}", part
    raise InvalidArgument("model", f"unexpected weight {name!r} for a {cfg.model_type} model")


def load_encoder(model_path: Path, model: BertModel, dtype: torch.dtype, device: torch.device,
                 pack: Callable) -> BertModel:
    """The folder's safetensors, or a GGUF file's tensors, into the encoder (q/k/v fused by rows), then
    cast, move and pack."""
    params = dict(model.named_parameters())
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for name, tensor in _checkpoint(Path(model_path)):
        target = _our_name(name, model.cfg)
        if target is None:
            continue
        path, part = target
        if part is None:
            _assign(params, path, tensor)
            loaded.add(path)
        else:
            pieces.setdefault(path, {})[part] = tensor
    for path, parts in pieces.items():
        _assign(params, path, torch.cat([parts[i] for i in sorted(parts)], dim=0))
        loaded.add(path)
    missing = sorted(set(params) - loaded)
    if missing:
        raise InvalidArgument("model", f"checkpoint lacks weights for {missing[:5]}")
    model = model.to(device=device, dtype=dtype)
    model.prepack(pack)
    return model


def _checkpoint(model_path: Path):
    """(HF name, tensor) for each tensor of the folder's *.safetensors or of the GGUF file."""
    if model_path.is_file():
        from services.worker.gguf_weights import read_encoder_tensors

        for name, array in read_encoder_tensors(model_path):
            yield name, torch.from_numpy(array)
        return
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise InvalidArgument("model", f"no *.safetensors in {model_path}")
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)


def _assign(params: dict[str, nn.Parameter], path: str, tensor: torch.Tensor) -> None:
    param = params.get(path)
    if param is None:
        raise InvalidArgument("model", f"weight {path} has no place in this model")
    if param.shape != tensor.shape:
        raise InvalidArgument("model", f"weight {path} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data = tensor.to(torch.float32)
