"""LoRA adapters in the PEFT format (adapter_config.json + adapter_model.safetensors) over the loaded base.

An adapter adds scale * B (A x) to the output of each linear layer it targets, for the rows of the
sequences that run under it; scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The base
weights are never touched, so one base serves many adapters, dense or quantized (int8, GGUF) alike.

Batch invariance (docs/ARCHITECTURE.md rule 4): the product runs per adapter over the rows of its
sequences, through the same linear layer as the base weights (kernels/linear.py: each output element one
FMA chain over k in a fixed order, whatever the number of rows), so a row's bits do not depend on which
other rows, or adapters, share the step; no grouped kernel sums across rows. A row without an adapter
gets nothing added, so its bits are the base model's.

Tensor/pipeline parallel groups give the bits of one process (load_adapter shards each adapter): a
column-parallel site (qkv, gate_up) adds, on each tensor rank, its own output rows of the same product (A
whole, B's rows); a row-parallel site (o, down) first gathers its input's columns from the tensor ranks
(a copy, no sum), so every rank computes the product of one process and adds it to the folded output, which
is already one process's bits (kernels/row_parallel.py). Each pipeline stage holds its layers' pieces.

Supported: the Llama family's attention and dense MLP projections (q, k, v, o, gate, up, down).

A worker holds at most max_cpu_loras adapters (LoraRegistry) and loads another on demand when a step sends
it a sequence under it, dropping the least recently used one no sequence it runs uses.
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from services.core.errors import InvalidArgument, check

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's target module -> (our fused site, which piece of it: an index into the site's output split)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, kw_only=True)
class LoraPiece:
    """One targeted projection: rows [start, end) of its site's output get scale * B (A x)."""

    start: int
    end: int
    a: object  # [r, in] packed for the linear layer (kernels.linear.prepack)
    b: object  # [out, r] packed


@dataclass(kw_only=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    pieces: dict[tuple[int, str], list[LoraPiece]] = field(default_factory=dict)  # (layer, site) -> pieces


def site_splits(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, intermediate: int) -> dict:
    """Each site's output split into the pieces PEFT targets, and its input width."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"qkv": ((q, kv, kv), hidden), "o": ((hidden,), q), "gate_up": ((intermediate, intermediate), hidden),
            "down": ((hidden,), intermediate)}


def arch_splits(cfg) -> dict:
    """site_splits of a ModelArchConfig (services/worker/model_config.py)."""
    return site_splits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size)


def read_config(path: Path, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scale, target modules) from adapter_config.json, checked: InvalidArgument naming the problem."""
    config_file = path / CONFIG_FILE
    check(path.is_dir(), "lora_path", f"{path} is not a folder")
    check(config_file.is_file(), "lora_path", f"{path} has no {CONFIG_FILE}")
    check((path / WEIGHTS_FILE).is_file(), "lora_path", f"{path} has no {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument("lora_path", f"{config_file} is not JSON: {e}") from e
    check(config.get("peft_type", "LORA") == "LORA", "lora_path", f"peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    check(isinstance(rank, int) and rank >= 1, "r", f"adapter rank must be a positive integer, got {rank!r}")
    check(rank <= max_rank, "r", f"adapter rank {rank} exceeds max_lora_rank {max_rank}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # PEFT also takes a regex or "all-linear"; we take the names only
        targets = [targets]
    unknown = sorted(set(targets) - set(TARGETS))
    check(not unknown and bool(targets), "target_modules",
          f"unsupported target modules {unknown or targets}; supported: {sorted(TARGETS)}")
    check(not config.get("modules_to_save"), "modules_to_save", "adapters that replace whole modules are not served")
    check(config.get("bias", "none") == "none", "bias", "adapters that train biases are not served")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale), tuple(sorted(set(targets)))


def load_adapter(name: str, path: str | Path, *, max_rank: int, cfg, shard, dtype: torch.dtype,
                 device: torch.device, pack: Callable) -> LoraAdapter:
    """The adapter at `path` checked against the whole model (layers, shapes), and this rank's part of it packed
    for the linear layers (shard: services/worker/parallel.py's Shard; one process holds all of it). A rank
    keeps its stage's layers; of a column-parallel projection (q, k, v, gate, up) the rows of B its outputs
    are, A whole; of a row-parallel one (o, down) A and B whole: its input is gathered first (LoraSite)."""
    path = Path(path)
    rank, scale, targets = read_config(path, max_rank)
    weights: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key.replace(".default.", "."))  # PEFT's saved names carry no adapter name
            check(match is not None, "lora_path", f"{WEIGHTS_FILE}: unexpected tensor {key!r}")
            layer, module, which = int(match.group(1)), match.group(3), match.group(4)
            check(module in targets, "target_modules", f"tensor {key!r} is for {module}, not a target module")
            check(layer < cfg.num_layers, "lora_path", f"tensor {key!r}: the model has {cfg.num_layers} layers")
            weights[(layer, module, which)] = f.get_tensor(key)
    adapter = LoraAdapter(name=name, path=str(path), rank=rank, scale=scale, target_modules=targets)
    whole, local = arch_splits(cfg), arch_splits(shard.local_arch(cfg))
    for (layer, module, which), a in sorted(weights.items()):
        if which != "A":
            continue
        b = weights.get((layer, module, "B"))
        check(b is not None, "lora_path", f"layer {layer} {module}: lora_A without lora_B")
        site, piece = TARGETS[module]
        sizes, width = whole[site]
        check(tuple(a.shape) == (rank, width), "lora_path",
              f"layer {layer} {module}.lora_A has shape {tuple(a.shape)}, expected {(rank, width)}")
        check(tuple(b.shape) == (sizes[piece], rank), "lora_path",
              f"layer {layer} {module}.lora_B has shape {tuple(b.shape)}, expected {(sizes[piece], rank)}")
        if not shard.holds_layer(layer, cfg):
            continue
        part = shard.slice_for(f"model.layers.{layer}.{'mlp' if site in ('gate_up', 'down') else 'self_attn'}."
                               f"{module}.weight", cfg)
        if part is not None and part[0] == 0:  # column-parallel: this rank's output rows
            b = b[part[1]:part[2]]
        start = sum(local[site][0][:piece])
        a, b = (t.to(device=device, dtype=dtype).contiguous() for t in (a, b))
        adapter.pieces.setdefault((layer, site), []).append(LoraPiece(start=start, end=start + b.shape[0],
                                                                         a=pack(a), b=pack(b)))
    check(any(which == "A" for _, _, which in weights), "lora_path", f"{WEIGHTS_FILE} holds no lora_A/lora_B pair")
    return adapter


@dataclass
class LoraBatch:
    """This step's adapters: each with the token rows of its sequences (ascending, disjoint)."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]

    def select(self, t0: int, t1: int) -> LoraBatch | None:
        """The part of tokens [t0, t1) (a pipeline micro-batch), its rows counted from t0; None: no adapter row."""
        groups = [(adapter, rows[(rows >= t0) & (rows < t1)] - t0) for adapter, rows in self.groups]
        groups = [(adapter, rows) for adapter, rows in groups if rows.numel()]
        return LoraBatch(groups) if groups else None


ROW_PARALLEL_SITES = ("o", "down")  # their input is split across tensor ranks (kernels/row_parallel.py)


class LoraState:
    """The current step's LoraBatch, read by every layer's sites; None while no row has an adapter.
    gather_columns (tensor parallel ranks only): [R, K / tp] of every tensor rank -> [R, K], side by side."""

    def __init__(self, linear: Callable, gather_columns: Callable | None = None):
        self.linear, self.gather_columns = linear, gather_columns
        self.batch: LoraBatch | None = None


class LoraSite:
    """One fused linear layer of one decoder layer (e.g. layer 3's qkv): adds each adapter's product."""

    def __init__(self, state: LoraState, layer: int, site: str):
        self.state, self.key = state, (layer, site)
        self.gathers = site in ROW_PARALLEL_SITES and state.gather_columns is not None

    def add(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # out [T, N] += per adapter rows
        batch = self.state.batch
        if batch is None:
            return out
        linear = self.state.linear
        for adapter, rows in batch.groups:
            pieces = adapter.pieces.get(self.key)
            if not pieces:
                continue
            x_rows = x[rows]  # [R, in]: a row-parallel site's whole input gathered, so A x is TP=1's one chain
            if self.gathers:
                x_rows = self.state.gather_columns(x_rows)
            for piece in pieces:
                delta = linear(linear(x_rows, piece.a, None), piece.b, None)  # [R, out]: per row, fixed order
                out[rows, piece.start:piece.end] = out[rows, piece.start:piece.end] + adapter.scale * delta
        return out


class LoraRegistry:
    """A worker's adapters: the folder of each one it knows (its --lora-modules, those loaded at run time or
    named by a step) and those it holds loaded, at most max_cpu_loras, least recently used first. Loading one
    past that drops the least recently used one that no sequence it runs uses; where every one is in use (the
    scheduler's max_loras slots prevent it) the new one runs unheld, so a request never fails for room."""

    def __init__(self, max_cpu_loras: int, load: Callable[[str, str], LoraAdapter]):
        self.max_cpu_loras, self._load = max_cpu_loras, load
        self.adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.paths: dict[str, str] = {}

    def load(self, name: str, path: str, in_use: set[str] = frozenset()) -> LoraAdapter:
        """The adapter `name`, loaded from `path` unless held (one known under another path is refused), and
        held after (used most recently)."""
        path = str(Path(path))
        known = self.paths.get(name)
        check(known in (None, path), "lora_name", f"adapter {name!r} is loaded from {known}; unload it before "
                                                  f"loading another path under its name")
        held = self.adapters.get(name)
        if held is not None:
            self.adapters.move_to_end(name)
            return held
        adapter = self._load(name, path)
        self.paths[name] = path
        while len(self.adapters) >= self.max_cpu_loras:
            victim = next((n for n in self.adapters if n not in in_use), None)
            if victim is None:
                return adapter
            del self.adapters[victim]
        self.adapters[name] = adapter
        return adapter

    def acquire(self, name: str, path: str, in_use: set[str]) -> LoraAdapter:
        """For a new sequence under `name`: the adapter, loaded on demand from `path` (a step's: one loaded at run
        time) or from the folder it is known by."""
        path = path or self.paths.get(name)
        check(bool(path), "lora_name", f"adapter {name!r} is not loaded on this worker (and no folder was given)")
        return self.load(name, path, in_use)

    def unload(self, name: str) -> None:
        """Forget `name` (its folder too); a no-op for one not known: the scheduler unloads from every worker."""
        self.adapters.pop(name, None)
        self.paths.pop(name, None)
