"""Random weights for a Llama-family checkpoint, streamed into one safetensors file.

The weights are drawn from one seeded torch.Generator, tensor by tensor in a fixed
order and in fixed-size row chunks, so the same (shapes, seed) give the same bytes and
memory stays bounded by one chunk even for a 1B-parameter model. The bytes are written
by hand in the safetensors layout (u64 header length, JSON header, raw little-endian
data) because `safetensors.torch.save_file` needs every tensor in memory at once.

Scales (see `_init_spec`) keep a random model useful for greedy-decoding tests: every
sublayer sees unit-RMS inputs, attention scores have a spread of about 2, and the
final logits have a standard deviation of about `LOGIT_STD`, so the top two logits are
rarely near a tie and different prompts lead to different continuations.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

LOGIT_STD = 3.0          # target std of the final logits
QK_GAIN = 2.0 ** 0.5     # q and k a bit larger than unit: sharper attention
NORM_NOISE = 0.1         # norm weights are 1 + NORM_NOISE * N(0, 1)
BIAS_STD = 0.3           # qwen2 q/k/v biases: large enough that dropping them shows
CHUNK_ELEMENTS = 1 << 22  # rows are drawn in chunks of about this many numbers

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    mean: float  # 1.0 for norm weights, 0.0 otherwise
    std: float


def param_specs(cfg: dict) -> list[ParamSpec]:
    """Every tensor of the checkpoint, with HF names, in file order."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim, vocab = cfg["head_dim"], cfg["vocab_size"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim
    specs = [ParamSpec(name="model.embed_tokens.weight", shape=(vocab, hidden), mean=0.0,
                       std=LOGIT_STD / math.sqrt(hidden))]
    for i in range(cfg["num_hidden_layers"]):
        specs += _layer_specs(f"model.layers.{i}.", cfg["model_type"], hidden, inter, head_dim, q_dim, kv_dim)
    specs.append(_norm("model.norm.weight", hidden))
    if not cfg["tie_word_embeddings"]:
        specs.append(
            ParamSpec(name="lm_head.weight", shape=(vocab, hidden), mean=0.0, std=LOGIT_STD / math.sqrt(hidden)))
    return specs


def _layer_specs(prefix: str, model_type: str, hidden: int, inter: int,
                 head_dim: int, q_dim: int, kv_dim: int) -> list[ParamSpec]:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    specs = [
        _linear(attn + "q_proj.weight", q_dim, hidden, QK_GAIN),
        _linear(attn + "k_proj.weight", kv_dim, hidden, QK_GAIN),
        _linear(attn + "v_proj.weight", kv_dim, hidden),
        _linear(attn + "o_proj.weight", hidden, q_dim),
    ]
    if model_type == "qwen2":
        specs += [ParamSpec(name=attn + f"{p}_proj.bias", shape=(d,), mean=0.0, std=BIAS_STD)
                  for p, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
    if model_type == "qwen3":
        specs += [_norm(attn + "q_norm.weight", head_dim), _norm(attn + "k_norm.weight", head_dim)]
    specs += [
        _linear(mlp + "gate_proj.weight", inter, hidden),
        _linear(mlp + "up_proj.weight", inter, hidden),
        _linear(mlp + "down_proj.weight", hidden, inter),
        _norm(prefix + "input_layernorm.weight", hidden),
        _norm(prefix + "post_attention_layernorm.weight", hidden),
    ]
    return specs


def _linear(name: str, out_features: int, in_features: int, gain: float = 1.0) -> ParamSpec:
    # unit-RMS input -> outputs of RMS about `gain`
    return ParamSpec(name=name, shape=(out_features, in_features), mean=0.0, std=gain / math.sqrt(in_features))


def _norm(name: str, dim: int) -> ParamSpec:
    return ParamSpec(name=name, shape=(dim,), mean=1.0, std=NORM_NOISE)


def count_params(specs: list[ParamSpec]) -> int:
    return sum(math.prod(s.shape) for s in specs)


def write_random_safetensors(path: Path, specs: list[ParamSpec], seed: int, dtype: torch.dtype) -> None:
    """Draw every tensor from one generator seeded with `seed` and stream it to `path`."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    item_size = torch.tensor([], dtype=dtype).element_size()
    for spec in specs:
        num_bytes = math.prod(spec.shape) * item_size
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for spec in specs:
            for chunk in _random_chunks(spec, generator):
                f.write(_to_bytes(chunk.to(dtype)))


def _random_chunks(spec: ParamSpec, generator: torch.Generator):
    """Yield the tensor as row chunks of at most about CHUNK_ELEMENTS numbers (fp32)."""
    row_shape = spec.shape[1:]
    row_elements = math.prod(row_shape)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row_elements)
    for start in range(0, spec.shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, spec.shape[0] - start)
        chunk = torch.randn((rows, *row_shape), generator=generator, dtype=torch.float32)
        yield chunk.mul_(spec.std).add_(spec.mean)


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; the bits are what matter
    return t.numpy().tobytes()
