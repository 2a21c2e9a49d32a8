"""A worker: the weights, the KV cache and the step. Plain class; the gRPC servicer wraps it.

With tensor_parallel_size x pipeline_parallel_size > 1 it is one rank of a worker group: the
WorkerGroup (services/worker/worker_group.py) spawns the ranks, broadcasts each step and runs the
followers' loop; the ranks' collectives are GroupComm's (services/worker/group.py).
"""
from __future__ import annotations

import dataclasses

import torch
import structlog

from kernels import build as kernel_build, cpu_kernels
from kernels.ops import get_ops
from services.core.config import CacheConfig, WorkerConfig
from services.core.errors import InvalidArgument, check
from services.core.lora import parse_lora_modules
from services.core.model_path import resolve_model_path, resolve_tokenizer_path
from services.core.step import StepDelta, StepResult, WorkerInfo
from services.worker.kv_cache import KVCache, block_bytes, num_blocks_for
from kernels.linear import invariant_linear, plain_linear, prepack
from services.worker.loader import (gguf_align, load_model, resolve_activation_quant, resolve_dtype,
                                   resolve_quantization)
from services.worker.model_config import ModelArchConfig
from services.worker.grammar import Grammars
from services.worker.lora import LoraRegistry, LoraState, load_adapter
from services.worker.async_scheduling import AsyncModelRunner
from services.worker.group import GroupComm
from services.worker.parallel import Shard, check_layout
from services.worker.pooler import architectures, make_pooler
from services.core.pooling import resolve_task

log = structlog.get_logger("worker")


def pick_device(name: str) -> torch.device:
    """auto: the current GPU if there is one, else the CPU. A GPU becomes this process's current device,
    named with its index: the Triton kernels launch on the current device, whatever their tensors'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise InvalidArgument("device", f"{name}: this process sees no CUDA device")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise InvalidArgument("device", f"{name}: this process sees {count} CUDA devices (cuda:0..cuda:{count - 1})")
    if device.index is not None:
        torch.cuda.set_device(device)
    return torch.device("cuda", torch.cuda.current_device())


def checked_layout(config: WorkerConfig, model_path, arch: ModelArchConfig, device_type: str) -> tuple[str, int]:
    """(the quantization, the K alignment its row-parallel groups need), after InvalidArgument naming the
    constraint where the model cannot be split as config's tensor/pipeline sizes say: each rank's check, and
    a group's before it spawns its ranks (WorkerGroup.start)."""
    quantization = resolve_quantization(config.quantization, model_path, device_type, arch.is_encoder)
    align = gguf_align(quantization, model_path)
    check_layout(arch, config.tensor_parallel_size, config.pipeline_parallel_size, align)
    return quantization, align


class Worker:
    """One rank: its shard of the weights, its KV cache, its ModelRunner. In a group (tensor_parallel_size x
    pipeline_parallel_size > 1) it joins the others at config.group_address; spawning the ranks, the
    broadcast to them and their follower loop are the group's (services/worker/worker_group.py)."""

    def __init__(self, config: WorkerConfig, cache: CacheConfig):
        self.config = config
        self.device = pick_device(config.device)
        self.model_path = resolve_model_path(config.model)
        self.tokenizer_path = resolve_tokenizer_path(config.tokenizer, self.model_path)
        arch = ModelArchConfig.from_model(self.model_path)
        self.task = resolve_task(config.task, self.model_path, architectures(self.model_path))
        if arch.is_encoder and self.task == "generate":
            raise InvalidArgument("task", f"{arch.model_type} is an encoder: serve it with --task embed or score")
        if self.task != "generate" and config.enable_lora:  # docs/guide/embeddings.md, "Limits"
            raise InvalidArgument("enable_lora", f"LoRA adapters are served for generation only, not by a worker "
                                                 f"of task {self.task} (start it without --enable-lora)")
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.quantization, align = checked_layout(config, self.model_path, arch, self.device.type)
        self.shard = Shard.of_rank(config.group_rank, tp, pp, align)
        self.dtype = resolve_dtype(config.dtype, arch, self.device)
        self.comm = None
        if self.shard.world_size > 1:
            if not config.group_address:
                raise ValueError("group_address: a rank of a worker group must be told where rank 0 is "
                                 "(WorkerGroup.start picks one for a group that one process starts)")
            self.comm = GroupComm(self.shard, config.group_address, self.dtype, arch.vocab_size, self.device,
                                  config.distributed_backend)
        torch.manual_seed(config.torch_seed)
        if config.num_threads:  # several workers (or ranks) on one machine must not oversubscribe its cores
            torch.set_num_threads(config.num_threads)
        kernel_build.set_build_dir(config.kernel_cache_dir)  # before get_ops builds the CPU kernels
        cpu_kernels.set_amx(config.amx)
        ops = get_ops(config.kernel_backend, self.device.type, config.cpu_isa)
        linear = invariant_linear if config.batch_invariant else plain_linear
        self.activation_quant = resolve_activation_quant(config.activation_quant, self.quantization, self.model_path)
        model = load_model(self.model_path, self.dtype, self.device, ops, linear, self.quantization, self.shard,
                           self.comm, self.activation_quant)
        model.micro_batches = config.pipeline_micro_batches or pp
        local = self.shard.local_arch(arch)  # this rank's KV heads and layers
        num_blocks = num_blocks_for(local, cache.block_size, self.dtype, self.device, cache.num_gpu_blocks,
                                    cache.kv_cache_memory_bytes)
        num_cpu_blocks = cache.swap_space_bytes // block_bytes(local, cache.block_size, self.dtype)
        if self.comm is not None:  # the group's capacity: every rank's cache holds every block id
            num_blocks, num_cpu_blocks = self.comm.min_over_ranks(num_blocks), self.comm.min_over_ranks(num_cpu_blocks)
        kv_cache = KVCache(local, num_blocks, num_cpu_blocks, cache.block_size, self.dtype, self.device,
                           allocate=not arch.is_encoder)  # an encoder never reads its KV: block ids, no memory
        num_cpu_blocks = kv_cache.num_cpu_blocks
        grammars = Grammars(self.tokenizer_path, arch.vocab_size, arch.eos_token_ids)
        pooler = None if self.task == "generate" else make_pooler(model, self.task, self.model_path,
                                                                  self.tokenizer_path, arch)
        loras = self._lora_registry(config, model, arch, linear) if config.enable_lora else None
        self.runner = AsyncModelRunner(model, kv_cache, self.device, config.batch_invariant, grammars, pooler, loras)
        self.info = WorkerInfo(
            model=str(self.model_path), dtype=str(self.dtype).removeprefix("torch."), block_size=cache.block_size,
            num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, vocab_size=arch.vocab_size,
            max_model_len=arch.max_position_embeddings, eos_token_ids=arch.eos_token_ids,
            device=self.device.type, batch_invariant=config.batch_invariant, task=self.task,
            pooling_whole=pooler is not None and pooler.whole,
            max_cpu_loras=config.max_cpu_loras if loras is not None else 0)
        modules = parse_lora_modules(config.lora_modules)
        for name, path in modules.items():  # a bad one stops the worker, named; it holds the last max_cpu_loras
            self.load_lora(name, path)
        # what it registers with (and GetInfo answers, which the scheduler's probe compares): its --lora-modules;
        # adapters loaded at run time are the scheduler's to remember (Scheduler.loras): a step under one that
        # this worker does not hold (it restarted, or dropped it) names its folder, and it loads it then
        self.info = dataclasses.replace(self.info, lora_names=tuple(modules))
        log.info("worker_ready", model=self.info.model, dtype=self.info.dtype, device=self.info.device,
                 num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, kernels=ops.name,
                 quantization=self.quantization, activation_quant=self.activation_quant, cpu_isa=cpu_kernels.active_tier() if ops.name == "cpu" else None,
                 rank=self.shard.rank, tensor_parallel_size=tp, pipeline_parallel_size=pp, task=self.task)

    def _lora_registry(self, config: WorkerConfig, model, arch: ModelArchConfig, linear) -> LoraRegistry:
        """The adapters this worker holds (services/worker/lora.py: this rank's part of each), the model's LoRA
        sites enabled."""
        gather = None
        if self.shard.tp_size > 1:
            comm = self.comm

            def gather(x: torch.Tensor) -> torch.Tensor:  # [R, K / tp] -> [R, K], the ranks' columns in order
                return comm.gather_partials(x.unsqueeze(0)).permute(1, 0, 2).reshape(x.shape[0], -1)
        model.enable_lora(LoraState(linear, gather))
        shard, dtype, device = self.shard, self.dtype, self.device

        def load(name: str, path: str):
            return load_adapter(name, path, max_rank=config.max_lora_rank, cfg=arch, shard=shard, dtype=dtype,
                                device=device, pack=prepack)
        return LoraRegistry(config.max_cpu_loras, load)

    def load_lora(self, name: str, path: str):
        """Hold adapter `name` from the PEFT folder `path` (a no-op where held from that path); InvalidArgument
        naming the problem for a bad adapter. Past max_cpu_loras the least recently used idle one is dropped
        (where all are in use it is only checked, and loaded again when a step needs it)."""
        registry = self._registry()
        adapter = registry.load(name, path, in_use=self.runner.loras_in_use([]))
        log.info("lora_loaded", lora_name=name, path=str(path), rank=adapter.rank, targets=list(adapter.target_modules))
        return adapter

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name`, a no-op where not held (the scheduler first checks that nothing runs or waits
        under it, Scheduler.retire_lora: this worker's mirrors may still hold finished sequences it was not yet
        told to forget)."""
        self._registry().unload(name)
        log.info("lora_unloaded", lora_name=name)

    def lora_names(self) -> list[str]:
        """The adapters held now (none without --enable-lora)."""
        return list(self.runner.loras.adapters) if self.runner.loras is not None else []

    def _registry(self) -> LoraRegistry:
        check(self.runner.loras is not None, "enable_lora", "this worker runs without --enable-lora")
        return self.runner.loras

    def step(self, delta: StepDelta) -> StepResult:
        return self.runner.execute(delta)

    def forget_all(self) -> None:
        """The scheduler dropped this worker: no sequence it holds will be named again."""
        self.runner.forget_all()

    def run_async_step(self) -> None:
        """Run the continuation the last step announced (async scheduling, StepDelta.async_next_step)
        while its result travels. A failure only costs the head start: the next delta then runs as usual."""
        try:
            self.runner.run_async_step()
        except Exception:  # noqa: BLE001 - never fatal: nothing was committed
            log.exception("async_step_failed")

    def close(self) -> None:
        """Leave the group (a rank of one); a no-op for a single process."""
        if self.comm is not None:
            self.comm.close()
