"""LoRA adapters in the PEFT format (adapter_config.json + adapter_model.safetensors) over the loaded base.

An adapter adds scale * B (A x) to the output of each linear layer it targets, for the rows of the
sequences that run under it; scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The base
weights are never touched, so one base serves many adapters, dense or quantized (int8, GGUF) alike.

Batch invariance (docs/ARCHITECTURE.md rule 4): the product runs per adapter over the rows of its
sequences, through the same linear layer as the base weights (kernels/linear.py: each output element one
FMA chain over k in a fixed order, whatever the number of rows), so a row's bits do not depend on which
other rows, or adapters, share the step; no grouped kernel sums across rows. A row without an adapter
gets nothing added, so its bits are the base model's.

Supported: the Llama family's attention and dense MLP projections (q, k, v, o, gate, up, down), in one
process (tensor/pipeline parallel groups refuse --enable-lora).

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


def load_adapter(name: str, path: str | Path, *, max_rank: int, num_layers: int, splits: dict,
                 dtype: torch.dtype, device: torch.device, pack: Callable) -> LoraAdapter:
    """The adapter at `path` checked against the model (layers, shapes) and packed for the linear layers."""
    path = Path(path)
    rank, scale, targets = read_config(path, max_rank)
    weights: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key.replace(".default.", "."))  # PEFT's saved names carry no adapter name
            check(match is not None, "lora_path", f"{WEIGHTS_FILE}: unexpected tensor {key!r}")
            layer, module, which = int(match.group(1)), match.group(3), match.group(4)
            check(module in targets, "target_modules", f"tensor {key!r} is for {module}, not a target module")
            check(layer < num_layers, "lora_path", f"tensor {key!r}: the model has {num_layers} layers")
            weights[(layer, module, which)] = f.get_tensor(key)
    adapter = LoraAdapter(name=name, path=str(path), rank=rank, scale=scale, target_modules=targets)
    for (layer, module, which), a in sorted(weights.items()):
        if which != "A":
            continue
        b = weights.get((layer, module, "B"))
        check(b is not None, "lora_path", f"layer {layer} {module}: lora_A without lora_B")
        site, piece = TARGETS[module]
        sizes, width = splits[site]
        check(tuple(a.shape) == (rank, width), "lora_path",
              f"layer {layer} {module}.lora_A has shape {tuple(a.shape)}, expected {(rank, width)}")
        check(tuple(b.shape) == (sizes[piece], rank), "lora_path",
              f"layer {layer} {module}.lora_B has shape {tuple(b.shape)}, expected {(sizes[piece], rank)}")
        start = sum(sizes[:piece])
        a, b = (t.to(device=device, dtype=dtype).contiguous() for t in (a, b))
        adapter.pieces.setdefault((layer, site), []).append(LoraPiece(start=start, end=start + sizes[piece],
                                                                         a=pack(a), b=pack(b)))
    check(bool(adapter.pieces), "lora_path", f"{WEIGHTS_FILE} holds no lora_A/lora_B pair")
    return adapter


@dataclass
class LoraBatch:
    """This step's adapters: each with the token rows of its sequences (ascending, disjoint)."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]


class LoraState:
    """The current step's LoraBatch, read by every layer's sites; None while no row has an adapter."""

    def __init__(self, linear: Callable):
        self.linear = linear
        self.batch: LoraBatch | None = None


class LoraSite:
    """One fused linear layer of one decoder layer (e.g. layer 3's qkv): adds each adapter's product."""

    def __init__(self, state: LoraState, layer: int, site: str):
        self.state, self.key = state, (layer, site)

    def add(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # out [T, N] += per adapter rows
        batch = self.state.batch
        if batch is None:
            return out
        linear = self.state.linear
        for adapter, rows in batch.groups:
            pieces = adapter.pieces.get(self.key)
            if not pieces:
                continue
            x_rows = x[rows]  # [R, in]
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
