"""The whole decoder stack in one call to the compiled CPU kernels (kernels/csrc/decoder.c).

The layer-by-layer path makes ~10 kernel calls per layer through ctypes, each with its tensor
allocations and views: 3-6 us of Python apiece, 1-3 ms of a decode step that takes 6-15 ms at
batch 1-16. decoder.c runs the same kernels in the same order on the same inputs, so it
gives the same bits (tests/kernels/test_decoder_stack.py); only the Python goes.

It runs where every linear weight is packed for the own GEMM or quantized (kernels/quant.py,
each weight's format passed along) and the activations, the norms and the KV cache share one
dtype (fp32 or bf16); anywhere else the model goes layer by layer. o and down are row-parallel
(kernels/row_parallel.py): their partial sums are gathered across a worker group's tensor ranks
by `gather`, a callback from inside the call (None in a single process).
"""
from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import cpu_kernels
from kernels.linear import GemmWeight
from kernels.quant import QuantParts, QuantWeight
from kernels.row_parallel import RowParallelWeight

OUT_OF_MEMORY, BAD_SHAPE, GATHER_FAILED = 1, 2, 3  # decoder_stack's status codes (kernels.h, decoder.c)
GATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_LAYER_FIELDS = ("input_norm", "post_attn_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "gate_up", "down",
                 "k_cache", "v_cache")


_LINEARS = ("qkv", "o", "gate_up", "down")  # DecoderLayer.formats' order


class _Layer(ctypes.Structure):  # DecoderLayer in decoder.c
    _fields_ = [*((name, ctypes.c_void_p) for name in _LAYER_FIELDS), ("formats", ctypes.c_int64 * 4),
                ("moe", ctypes.c_void_p)]


class _Stack(ctypes.Structure):  # DecoderStack in decoder.c
    _fields_ = [*((name, ctypes.c_int64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                                       "inter", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("is_bf16", ctypes.c_int),
                ("rotary_is_bf16", ctypes.c_int), ("rotary_cache", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.POINTER(_Layer)), ("groups", ctypes.c_int64), ("local_groups", ctypes.c_int64),
                ("gather", GATHER_FN)]


@dataclass(frozen=True, kw_only=True)
class LayerWeights:
    """One pre-norm decoder layer's weights (Llama, Mistral, Qwen2 with qkv_bias, Qwen3 with q/k norms; Qwen3-MoE and
    Mixtral with a mixture of experts for the MLP)."""
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    qkv: GemmWeight | QuantWeight | QuantParts  # q, k and v projections stacked: [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: RowParallelWeight
    gate_up: GemmWeight | QuantWeight | QuantParts | None = None  # gate and up stacked: [2 inter, hidden]
    down: RowParallelWeight | None = None
    # a mixture of experts in place of gate_up and down: moe.c's MoeLayer (services/worker/models/moe.py), whose
    # weights the MoE module keeps
    moe: ctypes.Structure | None = None


@dataclass(frozen=True, kw_only=True)
class StackShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    groups: int = 1  # the model's row-parallel K groups (kernels/row_parallel.py)
    max_tokens: int | None = None  # the most tokens a call takes (more: layer by layer); None: any number


class DecoderStack:
    """Callable: (embeddings [T, hidden], kv_caches, positions, slot_mapping, block_tables, token_seq,
    token_pos) -> the last layer's output with the final norm applied, [T, hidden]."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, rotary_cache: torch.Tensor,
                 shape: StackShape, gather: Callable[[torch.Tensor, torch.Tensor], None] | None = None):
        self.layers, self.final_norm, self.shape = layers, final_norm, shape
        self.gather = gather  # (local partials, all partials): the worker group's gather into the second
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # this call's partials, for the callback
        self._callback = GATHER_FN(self._gather) if gather is not None else GATHER_FN()
        self._error: BaseException | None = None
        self.rotary_cache = rotary_cache.contiguous()
        self.dtype = final_norm.dtype
        self._cache_key: tuple | None = None
        self._structs: tuple[ctypes.Array, _Stack] | None = None
        self._seen: tuple | None = None  # (the pairs, the first K cache's address and shape) _structs describe

    @classmethod
    def build(cls, layers: list[LayerWeights], final_norm: torch.Tensor, rotary_cache: torch.Tensor,
              shape: StackShape, gather: Callable | None = None) -> DecoderStack | None:
        """The stack, or None where decoder.c cannot run these weights (the caller goes layer by layer)."""
        dtype = final_norm.dtype
        if dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.is_available():
            return None
        if rotary_cache.dtype not in (torch.float32, torch.bfloat16):
            return None
        if shape.head_dim % cpu_kernels.LANES or shape.head_dim // cpu_kernels.LANES > cpu_kernels.MAX_CHUNKS:
            return None
        if not layers or shape.num_heads > cpu_kernels.MAX_HEADS or shape.num_heads % shape.num_kv_heads:
            return None
        if not all(_shapes_fit(layer, shape, final_norm.numel()) for layer in layers):
            return None  # decoder.c trusts them and would read past a weight
        if rotary_cache.dim() != 2 or rotary_cache.shape[1] != shape.head_dim:
            return None
        for layer in layers:
            names = ("input_norm", "post_attn_norm", "qkv_bias", "q_norm", "k_norm")
            tensors = [getattr(layer, name) for name in names]
            if (layer.moe is None) == (layer.gate_up is None or layer.down is None):
                return None  # a dense MLP or a mixture, one of them whole
            weights = [layer.qkv] if layer.moe is not None else [layer.qkv, layer.gate_up]
            if not all(isinstance(w, (GemmWeight, QuantWeight, QuantParts)) and w.dtype == dtype for w in weights):
                return None
            rows = [layer.o] if layer.moe is not None else [layer.o, layer.down]
            if not all(isinstance(w, RowParallelWeight) and w.fmt is not None and w.dtype == dtype for w in rows):
                return None
            if any(w.groups != layer.o.groups or w.total_groups != shape.groups for w in rows):
                return None
            weights += [p for w in rows for p in w.parts]
            if any(isinstance(w, GemmWeight) for w in weights) and not cpu_kernels.gemm_supported(dtype):
                return None
            if not all(t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in tensors if t is not None):
                return None
            if (layer.q_norm is None) != (layer.k_norm is None):
                return None
        return cls(layers, final_norm.contiguous(), rotary_cache, shape, gather)

    def runs(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this step's tensors suit decoder.c (the same dtype everywhere, contiguous caches on the CPU)."""
        if x.dtype != self.dtype or not x.is_cpu:
            return False
        if self.shape.max_tokens is not None and x.shape[0] > self.shape.max_tokens:
            return False
        return self._same_caches(kv_caches) or self._caches_fit(kv_caches)  # the first: checked at an earlier step

    def _caches_fit(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        heads = (self.shape.num_kv_heads, self.shape.head_dim)
        return all(c.dtype == self.dtype and c.is_cpu and c.is_contiguous() and tuple(c.shape[2:]) == heads
                   for pair in kv_caches for c in pair)

    def _same_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether these are the very (K, V) pairs the descriptors were built for, the first one still at its
        address and shape: a worker allocates its caches once, so every step after the first takes this
        check instead of looking at 2 x layers tensors (~0.5 ms a step, 4% of a batch-1 decode step)."""
        seen = self._seen
        return (seen is not None and len(kv_caches) == len(seen[0]) and all(map(operator.is_, kv_caches, seen[0]))
                and kv_caches[0][0].data_ptr() == seen[1] and kv_caches[0][0].shape == seen[2])

    def __call__(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, token_seq: torch.Tensor,
                 token_pos: torch.Tensor, residual: torch.Tensor | None = None,
                 final_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, None) with the final norm applied, or (x, residual) for the next pipeline stage.
        residual: the residual stream from the previous stage (None: x is the embedding)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        res_out = None if final_norm else torch.empty_like(x)
        if x.shape[0] == 0:
            return out, res_out
        if residual is not None:
            residual = residual.contiguous()
        stack = self._stack(kv_caches)
        ints = [t.to(torch.int64).contiguous() for t in (positions, slot_mapping, block_tables, token_seq, token_pos)]
        positions, slots, tables, token_seq, token_pos = ints
        num_tokens, hidden = x.shape
        local_groups = self.layers[0].o.groups
        local = torch.empty(local_groups, num_tokens, hidden, dtype=torch.float32)
        everything = torch.empty(self.shape.groups, num_tokens, hidden) if self.gather is not None else local
        self._buffers, self._error = (local, everything), None
        try:
            status = cpu_kernels.library().decoder_stack(
                ctypes.addressof(stack), x.data_ptr(), _ptr(residual), out.data_ptr(), _ptr(res_out), num_tokens,
                positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], token_seq.data_ptr(),
                token_pos.data_ptr(), local.data_ptr(), everything.data_ptr(), torch.get_num_threads())
        finally:
            self._buffers = None
        if status == GATHER_FAILED and self._error is not None:
            raise self._error
        if status == OUT_OF_MEMORY:
            raise MemoryError("decoder_stack: out of memory for the scratch buffers")
        if status != 0:
            raise ValueError(f"decoder_stack: shape not supported (status {status})")
        return out, res_out

    def _gather(self, layer: int, which: int) -> int:
        """decoder.c's callback: the partials of this call's buffers gathered across the tensor ranks."""
        try:
            self.gather(*self._buffers)
            return 0
        except BaseException as error:  # noqa: BLE001 - raised again once decoder_stack has returned
            self._error = error
            return 1

    def _stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> _Stack:
        """The C descriptors, rebuilt only when the caches move or change shape (they are allocated
        once per worker; a new cache at the same address may have another block size)."""
        if self._same_caches(kv_caches):
            return self._structs[1]
        key = (tuple(kv_caches[0][0].shape), *(c.data_ptr() for pair in kv_caches for c in pair))
        if key != self._cache_key:
            if len(kv_caches) != len(self.layers):
                raise ValueError(f"decoder_stack: {len(kv_caches)} KV caches for {len(self.layers)} layers")
            self._structs = self._describe(kv_caches)
            self._cache_key = key
        if self._caches_fit(kv_caches):  # once per new set of caches: then runs() trusts _same_caches
            self._seen = (tuple(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[0][0].shape)
        return self._structs[1]

    def _describe(self, kv_caches) -> tuple[ctypes.Array, _Stack]:
        def ptr(t) -> int | None:
            if t is None:
                return None
            if isinstance(t, (QuantWeight, QuantParts)):
                return t.data.data_ptr()
            if isinstance(t, RowParallelWeight):
                return t.buffer.data_ptr()
            return (t.packed if isinstance(t, GemmWeight) else t).data_ptr()

        array = (_Layer * len(self.layers))()
        for slot, layer, (k_cache, v_cache) in zip(array, self.layers, kv_caches):
            for name in _LAYER_FIELDS[:-2]:
                setattr(slot, name, ptr(getattr(layer, name)))
            slot.k_cache, slot.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            for i, name in enumerate(_LINEARS):  # 0: packed for gemm.c (or none: a mixture's); else quant_gemm.c's
                weight = getattr(layer, name)
                slot.formats[i] = (weight.kernel_fmt if isinstance(weight, (QuantWeight, QuantParts)) else weight.fmt
                                   if isinstance(weight, RowParallelWeight) else 0)
            slot.moe = ctypes.addressof(layer.moe) if layer.moe is not None else None
        first, shape = self.layers[0], self.shape
        dense = [layer for layer in self.layers if layer.down is not None]
        stack = _Stack(
            num_layers=len(self.layers), hidden=first.o.out_features, num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            inter=dense[0].down.in_features if dense else 0,
            block_size=kv_caches[0][0].shape[1], eps=shape.eps, scale=shape.scale,
            is_bf16=int(self.dtype == torch.bfloat16), rotary_is_bf16=int(self.rotary_cache.dtype == torch.bfloat16),
            rotary_cache=self.rotary_cache.data_ptr(), final_norm=self.final_norm.data_ptr(),
            layers=ctypes.cast(array, ctypes.POINTER(_Layer)), groups=shape.groups, local_groups=first.o.groups,
            gather=self._callback)
        return array, stack


def _shapes_fit(layer: LayerWeights, shape: StackShape, hidden: int) -> bool:
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    expected = {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size)}
    if layer.moe is not None:
        if layer.moe.hidden != hidden:
            return False
    else:
        inter = layer.down.shape[1]  # a packed or a dense weight: both have a shape
        expected |= {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    if any(tuple(getattr(layer, name).shape) != want for name, want in expected.items()):
        return False
    vectors = {"input_norm": hidden, "post_attn_norm": hidden, "qkv_bias": q_size + 2 * kv_size,
               "q_norm": shape.head_dim, "k_norm": shape.head_dim}
    return all(getattr(layer, name) is None or getattr(layer, name).numel() == size for name, size in vectors.items())


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None
