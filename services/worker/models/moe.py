"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama family's layers with the MLP replaced by
a router and a set of experts, each expert the Llama family's gated MLP (services/worker/models/llama.py).

Per step (`MoE.forward`): where the experts take int8 activations in one format each in one process, the
whole MLP below is one call into the compiled kernels (kernels/csrc/moe.c `moe_forward`, the route included),
which decoder.c's one-call stack makes too; otherwise, step by step here:
- the router's softmax (fp32) picks each token's top-k experts, normalised as the model does (Mixtral
  always renormalises the k weights; Qwen3-MoE where norm_topk_prob): moe.c's `moe_route` on the compiled
  kernels (the same route as moe_forward's), torch's softmax and top-k on the other backends;
- the (token, expert) pairs are grouped by expert in one sort (`ExpertGroups`) and the tokens' rows
  gathered once, so that each expert's rows are one contiguous slice;
- each expert that some token chose multiplies its slice once, [gate, up] in one call, its weights read
  once per step for all its rows; the activation runs once over every row; then each expert's down_proj.
  Where the compiled CPU kernels run the weights, each call writes into the step's buffers through
  ctypes (no per-expert tensors); otherwise each expert's slice goes through the model's linear function.
  Experts quantized with int8 activations (one format) take one call for all of a step's experts per
  projection instead (quant_dot.c's quant_experts_int8: one quantization of the rows, one parallel region,
  the bits of each expert's own call): at decode 2 parallel regions a layer where the experts' own calls
  opened 2 each, whose joins and uneven shares were about a third of the layer's time;
- a token's output is the sum of its k weighted expert outputs added in ascending expert id
  (transformers' order), from its own rows only.
Every kernel gives a row the same bits whatever rows share its call, and the activation and the sum are
row by row, so a token's output has the same bits whichever other tokens share its experts
(docs/ARCHITECTURE.md rule 4), at batch 1 as in a prefill of thousands.

Tensor parallel: every rank holds its columns of every expert (the MLP's split), the router whole. down_proj
is row-parallel (kernels/row_parallel.py): each expert's K-group partials land in one buffer for every row
of the step, gathered once and folded once, the same bits as the one-process path.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from kernels import cpu_kernels
from kernels import quant as quant_kernels
from kernels import row_parallel
from kernels.linear import GemmWeight
from kernels.ops import Ops
from kernels.quant import QuantParts, QuantWeight
from kernels.row_parallel import RowParallelWeight
from services.worker.model_config import ModelArchConfig
from services.worker.models.llama import MLP, DecoderLayer, LlamaForCausalLM


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, slot) pairs grouped by expert: `pairs` [T k] the pair indices (token * k + slot)
    in expert order, tokens ascending within an expert; `spans` (expert, start, stop) of each chosen
    expert's rows among them, in expert order."""
    pairs: torch.Tensor
    spans: list[tuple[int, int, int]]

    @classmethod
    def of(cls, experts: torch.Tensor, num_experts: int) -> ExpertGroups:  # experts [T, k]
        flat = experts.reshape(-1)
        pairs = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        spans, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                spans.append((expert, start, start + count))
                start += count
        return cls(pairs=pairs, spans=spans)


class MoE(nn.Module):
    linear_weights = ("router_weight",)
    dense_weights = ("router_weight",)  # kept in the activation dtype under --quantization int8: routing as trained
    _tables: _ExpertTables | None = None  # the experts' weights for quant_experts_int8, set at the first step (a
    # class default: a subclass's own __init__, gpt_oss.py's, need not know of it)

    _one_call: _MoeLayer | bool | None = None  # moe.c's descriptor of this layer, False where it does not run it

    def __init__(self, cfg: ModelArchConfig, ops: Ops, linear: Callable):
        super().__init__()
        self.ops, self.linear, self.top_k, self.normalize = ops, linear, cfg.experts_per_token, cfg.norm_topk_prob
        self.router_weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.experts = nn.ModuleList(MLP(cfg, ops, linear) for _ in range(cfg.num_experts))
        self._down_biases = None  # [E, H] stacked at the first step where the experts have down biases

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> weights, experts [T, k]
        logits = self.linear(x, self.router_weight, None)
        if self.ops.moe_route is not None and logits.is_cpu:  # the backend's own (moe.c's on the compiled kernels)
            weights, experts = self.ops.moe_route(logits, self.top_k, self.normalize)
            return weights.to(x.dtype), experts
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        layer = self.one_call(x)
        if layer is not None:  # moe.c: the route, the experts and the sum in one call, the bits of the path below
            x = x.contiguous()
            out = torch.empty_like(x)
            status = _kernels(x).moe_forward(ctypes.addressof(layer), x.data_ptr(), x.stride(0), x.shape[0],
                                             int(x.dtype == torch.bfloat16), out.data_ptr(), out.stride(0),
                                             torch.get_num_threads())
            if status == quant_kernels.OUT_OF_MEMORY:
                raise MemoryError("moe_forward: out of memory for the layer's rows")
            if status != quant_kernels.OK:
                raise ValueError(f"moe_forward: status {status}")
            return out
        weights, experts = self.route(x)
        num_tokens, k = experts.shape
        experts, order = experts.sort(dim=-1)  # each token's k experts in ascending id: the order they are added in
        weights = weights.gather(1, order)
        groups = ExpertGroups.of(experts, len(self.experts))
        rows = x[groups.pairs // k]  # [T k, H]: each pair's token row, grouped by expert
        hidden = self.experts[0].activate(self.gate_up(rows, groups.spans))  # one call over every row
        down = self.down(hidden, groups.spans, x.dtype)
        if getattr(self.experts[0], "down_bias", None) is not None:
            down = down + self.down_biases()[experts.reshape(-1)[groups.pairs]]
        outs = torch.empty_like(down)
        outs[groups.pairs] = down  # back in (token, slot) order
        outs = outs.view(num_tokens, k, x.shape[1]) * weights[:, :, None]
        total = torch.zeros_like(x)
        for slot in range(k):
            total = total + outs[:, slot]
        return total

    def one_call(self, x: torch.Tensor) -> _MoeLayer | None:
        """moe.c's descriptor of this layer where moe_forward runs it on rows like x, else None."""
        layer = self.descriptor()
        if layer is None or x.dtype != self._tables.gate_up.dtype or x.dim() != 2 or not x.is_cpu:
            return None
        if x.shape[0] >= AMX_ROWS and self.amx_rows():
            return None
        return layer

    def amx_rows(self) -> bool:
        """Whether the experts' own calls take the AMX tiles at AMX_ROWS rows an expert (the same bits, faster
        there), so that moe_forward leaves steps of AMX_ROWS tokens or more to them."""
        layer = self.descriptor()
        return (layer is not None and _amx(quant_kernels.declare(cpu_kernels.library()))
                and not {layer.gate_up_format & 0xff, layer.down_format & 0xff} <= NO_AMX_FORMATS)

    def descriptor(self) -> _MoeLayer | None:
        """moe.c's descriptor of this layer (built once), or None where moe_forward does not run it: it takes
        the compiled kernels' route and activation (this class's own), the experts in one format each with
        int8 activations in one process (quant_experts_int8's tables), the router packed for gemm.c, no biases."""
        if self._one_call is None:
            self._one_call = self._describe() or False
        return self._one_call or None

    def _describe(self) -> _MoeLayer | None:
        first, router = self.experts[0], self.router_weight
        if type(self).route is not MoE.route:  # a subclass's own route (gpt_oss.py's, whose __init__ is its own)
            return None
        if (self.ops.moe_route is not cpu_kernels.moe_route_cpu or first.activation is not cpu_kernels.silu_and_mul_cpu
                or not cpu_kernels.is_available()):
            return None
        if self._tables is None:
            self._tables = _ExpertTables.of(self.experts)
        tables = self._tables
        if tables.gate_up is None or tables.down is None or getattr(first, "down_bias", None) is not None:
            return None
        if not isinstance(router, GemmWeight) or len({router.dtype, tables.gate_up.dtype, tables.down.dtype}) != 1:
            return None
        down = first.down_weight
        groups = down.groups if isinstance(down, RowParallelWeight) else 1
        return _MoeLayer(router=router.packed.data_ptr(), router_format=0,
                         gate_up=tables.gate_up.addresses.data_ptr(), down=tables.down.addresses.data_ptr(),
                         num_experts=len(self.experts), top_k=self.top_k, hidden=router.in_features,
                         inter=tables.gate_up.out_features // 2, down_groups=groups,
                         gate_up_format=tables.gate_up.fmt, down_format=tables.down.fmt, normalize=int(self.normalize))

    def down_biases(self) -> torch.Tensor:
        if self._down_biases is None:
            self._down_biases = torch.stack([expert.down_bias.data for expert in self.experts])
        return self._down_biases

    def gate_up(self, rows: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:  # [R, H] -> [R, 2I]
        first = self.experts[0]
        out = rows.new_empty(rows.shape[0], first.gate_up_weight.shape[0])
        lib = _kernels(rows)
        if lib is not None and self._tables is None:
            self._tables = _ExpertTables.of(self.experts)
        if lib is not None and self._tables.gate_up is not None and _experts_into(lib, rows, self._tables.gate_up,
                                                                                    spans, 1, out):
            return out
        for expert, start, stop in spans:
            module = self.experts[expert]
            weight, bias = module.gate_up_weight, getattr(module, "gate_up_bias", None)
            if lib is None or not _linear_into(lib, rows[start:stop], weight, bias, out[start:stop]):
                out[start:stop] = self.linear(rows[start:stop], weight, bias)
        return out

    def down(self, hidden: torch.Tensor, spans: list[tuple[int, int, int]], dtype: torch.dtype) -> torch.Tensor:
        """Each expert's down_proj on its rows [R, I] -> [R, H]: in one process with compiled kernels each
        expert's one call (row_parallel.c's, the partials folded in registers or in its scratch); else every
        expert's K-group partials in one buffer, gathered across the ranks once and folded once."""
        first = self.experts[0].down_weight
        if not isinstance(first, RowParallelWeight):  # a caller that did not prepack (the reference)
            out = hidden.new_empty(hidden.shape[0], first.shape[0])
            for expert, start, stop in spans:
                out[start:stop] = self.linear(hidden[start:stop], self.experts[expert].down_weight, None)
            return out
        num_rows, n = hidden.shape[0], first.out_features
        if first.gather is None and first.groups == first.total_groups and first._compiled(hidden):
            hidden = hidden.contiguous()
            out = torch.empty(num_rows, n, dtype=hidden.dtype)
            lib = _kernels(hidden)
            if lib is not None and self._tables is None:
                self._tables = _ExpertTables.of(self.experts)
            if lib is not None and self._tables.down is not None and _experts_into(lib, hidden, self._tables.down,
                                                                                     spans, first.groups, out):
                return out
            longest = max((stop - start for _, start, stop in spans), default=0)
            scratch = None if first.fmt == 0 else torch.empty(first.groups, longest, n)
            lib, elem = row_parallel.library(), hidden.element_size()
            for expert, start, stop in spans:
                weight = self.experts[expert].down_weight
                status = lib.row_parallel_linear(
                    hidden.data_ptr() + start * hidden.stride(0) * elem, hidden.stride(0), weight.buffer.data_ptr(),
                    weight.fmt, weight.groups, stop - start, n, weight.in_features // weight.groups,
                    int(hidden.dtype == torch.bfloat16), out.data_ptr() + start * n * elem, n,
                    None if scratch is None else scratch.data_ptr(), torch.get_num_threads(), None)
                if status != 0:
                    raise ValueError(f"row_parallel_linear: status {status}")
            return out
        partials = torch.empty(first.groups, num_rows, n, dtype=torch.float32, device=hidden.device)
        for expert, start, stop in spans:
            partials[:, start:stop] = self.experts[expert].down_weight.partials(hidden[start:stop])
        if first.gather is not None:
            partials = first.gather(partials)
        return first.fold(partials, dtype)


class _MoeLayer(ctypes.Structure):  # MoeLayer in kernels.h (moe.c)
    _fields_ = [("router", ctypes.c_void_p), ("router_format", ctypes.c_int64), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), *((name, ctypes.c_int64) for name in ("num_experts", "top_k", "hidden",
                                                                                 "inter", "down_groups")),
                ("gate_up_format", ctypes.c_int), ("down_format", ctypes.c_int), ("normalize", ctypes.c_int)]


@dataclass(frozen=True, kw_only=True)
class _ExpertTable:
    """One projection of every expert as quant_experts_int8 takes it: the format (without the int8-activation
    bit), the shape and each expert's address; `keep` holds the tensors that own the bytes."""
    fmt: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    addresses: torch.Tensor = field(repr=False)  # int64 [E]
    keep: tuple = field(repr=False)

    @classmethod
    def of(cls, weights: list) -> _ExpertTable | None:
        """The table where every weight is quantized with int8 activations (a QuantWeight, or a RowParallelWeight
        of them in one process) of one format and shape, else None (each expert's own call)."""
        first = weights[0]
        if isinstance(first, RowParallelWeight):
            if first.gather is not None or first.groups != first.total_groups or first.buffer is None:
                return None
            quant = [w.parts[0] if isinstance(w, RowParallelWeight) else None for w in weights]
            data = [w.buffer if isinstance(w, RowParallelWeight) else None for w in weights]
            shapes = {(w.groups, w.out_features, w.in_features) if isinstance(w, RowParallelWeight) else None
                      for w in weights}
        else:
            quant, data = weights, [getattr(w, "data", None) for w in weights]
            shapes = {(1, *w.shape) if isinstance(w, QuantWeight) else None for w in weights}
        if len(shapes) != 1 or None in shapes or not all(
                isinstance(q, QuantWeight) and q.int8_activations and q.kernel_fmt == quant[0].kernel_fmt
                and q.dtype == quant[0].dtype for q in quant) or quant[0].fmt not in ONE_CALL_FORMATS:
            return None
        return cls(fmt=quant[0].kernel_fmt & ~quant_kernels.ACT_INT8, out_features=first.shape[0],
                   in_features=first.shape[1], dtype=quant[0].dtype,
                   addresses=torch.tensor([d.data_ptr() for d in data], dtype=torch.int64), keep=tuple(data))


@dataclass(frozen=True)
class _ExpertTables:
    gate_up: _ExpertTable | None
    down: _ExpertTable | None

    @classmethod
    def of(cls, experts: nn.ModuleList) -> _ExpertTables:
        biased = any(getattr(e, "gate_up_bias", None) is not None for e in experts)
        return cls(gate_up=None if biased else _ExpertTable.of([e.gate_up_weight for e in experts]),
                   down=_ExpertTable.of([e.down_weight for e in experts]))


AMX_ROWS = 10  # an expert with this many rows takes its own call where the AMX tiles run (quant_dot.c)
# what quant_experts_int8 runs: every int8-activation format (the super-block K-quants' rows per super-block of 256)
ONE_CALL_FORMATS = frozenset(quant_kernels.INT8_ACTIVATION_FORMATS)
NO_AMX_FORMATS = frozenset(quant_kernels.KQUANT_INT8)  # quant_dot.c's AMX tiles take none of these


def _experts_into(lib: ctypes.CDLL, rows: torch.Tensor, table: _ExpertTable, spans: list[tuple[int, int, int]],
                  groups: int, out: torch.Tensor) -> bool:
    """Every chosen expert's projection of its rows into out by quant_experts_int8 (one quantization of the
    rows, one parallel region: the bits of each expert's own call, `groups` K groups folded as
    row_parallel_linear folds them); False where it does not run these (the caller's per-expert calls)."""
    if rows.dtype != table.dtype or rows.stride(1) != 1 or out.stride(1) != 1 or not spans:
        return False
    if (table.fmt & 0xff) not in NO_AMX_FORMATS and max(stop - start for _, start, stop in spans) >= AMX_ROWS \
            and _amx(lib):
        return False  # the AMX tiles (the same bits) are faster on an expert's many rows
    ids = torch.tensor([expert for expert, _, _ in spans], dtype=torch.int64)
    bounds = torch.tensor([(start, stop) for _, start, stop in spans], dtype=torch.int64)
    addresses = table.addresses[ids]
    status = lib.quant_experts_int8(
        rows.data_ptr(), rows.stride(0), bounds.data_ptr(), addresses.data_ptr(), len(spans), table.fmt, groups,
        rows.shape[0], table.out_features, table.in_features, int(rows.dtype == torch.bfloat16), out.data_ptr(),
        out.stride(0), torch.get_num_threads())
    if status == quant_kernels.OUT_OF_MEMORY:
        raise MemoryError("quant_experts_int8: out of memory for the quantized rows")
    if status != quant_kernels.OK:  # _ExpertTable.of took only what it runs
        raise ValueError(f"quant_experts_int8: {quant_kernels.NAMES.get(table.fmt & 0xff, table.fmt)} experts "
                         f"[{table.out_features}, {table.in_features}] in {groups} groups: status {status}")
    return True


_amx_permitted: dict[int, bool] = {}


def _amx(lib: ctypes.CDLL) -> bool:
    """Whether this library takes quant_dot.c's AMX tiles (asked once per library)."""
    if id(lib) not in _amx_permitted:
        _amx_permitted[id(lib)] = bool(lib.quant_dot_amx())
    return _amx_permitted[id(lib)]


def _kernels(rows: torch.Tensor) -> ctypes.CDLL | None:
    """The compiled kernels' library (quant_linear declared) where they multiply these rows, else None."""
    if not rows.is_cpu or rows.dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.is_available():
        return None
    return quant_kernels.declare(cpu_kernels.library())


def _linear_into(lib: ctypes.CDLL, rows: torch.Tensor, weight, bias: torch.Tensor | None, out: torch.Tensor) -> bool:
    """rows W^T + bias written into out (a slice of the step's buffer) by the kernel the weight's own call
    runs (quant_linear, or gemm.c's linear for a packed dense weight), the same bits; False for any other
    weight (the caller takes the linear function)."""
    quantized = isinstance(weight, (QuantWeight, QuantParts))
    if not (quantized or isinstance(weight, GemmWeight) and weight.dtype == rows.dtype) or rows.stride(1) != 1:
        return False
    if quantized:
        quant_kernels.run_kernel(lib, rows, weight, bias, out=out)
    else:
        cpu_kernels.linear_cpu(rows, weight.packed, weight.out_features, weight.in_features, bias, out=out)
    return True


class MoeForCausalLM(LlamaForCausalLM):
    def stack_mlp(self, layer: nn.Module) -> dict | None:
        """decoder.c runs a mixture through moe.c where moe_forward takes its weights."""
        descriptor = layer.mlp.descriptor() if isinstance(layer.mlp, MoE) else None
        return None if descriptor is None else {"moe": descriptor}

    def stack_max_tokens(self) -> int | None:
        return AMX_ROWS - 1 if any(layer.mlp.amx_rows() for layer in self.layers) else None

    def make_layer(self, local: ModelArchConfig, index: int) -> nn.Module:
        return DecoderLayer(local, self.ops, self.linear, self.cfg.window(index), mlp=MoE(local, self.ops, self.linear))
