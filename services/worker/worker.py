"""A worker: the weights, the KV cache and the step. Plain class; the gRPC servicer wraps it.

With tensor_parallel_size x pipeline_parallel_size > 1 it is one rank of a worker group
(services/worker/group.py): rank 0 is the worker the scheduler sees, the others `follow` it.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import time

import torch
import structlog

from kernels import cpu_kernels
from kernels.ops import get_ops
from services.core.config import CacheConfig, WorkerConfig
from services.core.errors import InvalidArgument, Unavailable, UnknownSequence, check
from services.core.lora import parse_lora_modules
from services.core.model_path import resolve_model_path, resolve_tokenizer_path
from services.core.step import StepDelta, StepResult, WorkerInfo
from services.worker.kv_cache import KVCache, block_bytes, num_blocks_for
from kernels.linear import invariant_linear, plain_linear, prepack
from services.worker.loader import (gguf_align, load_model, resolve_activation_quant, resolve_dtype,
                                   resolve_quantization)
from services.worker.model_config import ModelArchConfig
from services.worker.grammar import Grammars
from services.worker.lora import LoraRegistry, LoraState, load_adapter, site_splits
from services.worker.async_scheduling import AsyncModelRunner
from services.worker.parallel import Shard, check_layout
from services.worker.pooler import architectures, make_pooler
from services.core.pooling import resolve_task

log = structlog.get_logger("worker")


class GroupBroken(Unavailable):
    """A rank of this worker's group failed or is gone: the group cannot step any more (its process
    exits, the scheduler recomputes its sequences elsewhere, the launcher restarts the group)."""


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


class Worker:
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
        self.quantization = resolve_quantization(config.quantization, self.model_path, self.device.type)
        align = gguf_align(self.quantization, self.model_path)
        check_layout(arch, tp, pp, align)
        self.shard = Shard.of_rank(config.group_rank, tp, pp, align)
        self.followers: list = []
        self.comm = None
        self.broken = False  # a rank failed: the group steps no more
        self.rank_threads = 0  # a group rank 0 started on this machine: each rank's share of the threads
        if self.shard.world_size > 1:
            self.comm = self._join_group(config, cache)
        self.dtype = resolve_dtype(config.dtype, arch, self.device)
        torch.manual_seed(config.torch_seed)
        threads = self.rank_threads or config.num_threads
        if threads:  # several workers (or ranks) on one machine must not oversubscribe its cores
            torch.set_num_threads(threads)
        ops = get_ops(config.kernel_backend, self.device.type, config.cpu_isa)
        linear = invariant_linear if config.batch_invariant else plain_linear
        if self.comm is not None:
            self.comm.set_vocab_size(arch.vocab_size)
            self.comm.dtype = self.dtype
        self.activation_quant = resolve_activation_quant(config.activation_quant, self.quantization)
        model = load_model(self.model_path, self.dtype, self.device, ops, linear, self.quantization, self.shard,
                           self.comm, self.activation_quant)
        model.micro_batches = config.pipeline_micro_batches or pp
        local = self.shard.local_arch(arch)  # this rank's KV heads and layers
        num_blocks = num_blocks_for(local, cache.block_size, self.dtype, self.device, cache.num_gpu_blocks,
                                    cache.kv_cache_memory_bytes)
        num_cpu_blocks = cache.swap_space_bytes // block_bytes(local, cache.block_size, self.dtype)
        if self.comm is not None:  # the group's capacity: every rank's cache holds every block id
            num_blocks, num_cpu_blocks = self.comm.min_over_ranks(num_blocks), self.comm.min_over_ranks(num_cpu_blocks)
        kv_cache = KVCache(local, num_blocks, num_cpu_blocks, cache.block_size, self.dtype, self.device)
        grammars = Grammars(self.tokenizer_path, arch.vocab_size, arch.eos_token_ids)
        pooler = None if self.task == "generate" else make_pooler(model, self.task, self.model_path,
                                                                  self.tokenizer_path, arch)
        loras = self._lora_registry(config, model, local, linear) if config.enable_lora else None
        self.runner = AsyncModelRunner(model, kv_cache, self.device, config.batch_invariant, grammars, pooler, loras)
        self.info = WorkerInfo(
            model=str(self.model_path), dtype=str(self.dtype).removeprefix("torch."), block_size=cache.block_size,
            num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, vocab_size=arch.vocab_size,
            max_model_len=arch.max_position_embeddings, eos_token_ids=arch.eos_token_ids,
            device=self.device.type, batch_invariant=config.batch_invariant, task=self.task,
            pooling_whole=pooler is not None and pooler.whole)
        for name, path in parse_lora_modules(config.lora_modules).items():  # a bad one stops the worker, named
            self.load_lora(name, path)
        # what it registers with (and GetInfo answers, which the scheduler's probe compares): its --lora-modules;
        # adapters loaded at run time are the scheduler's to remember (set_worker_loras)
        self.info = dataclasses.replace(self.info, lora_names=tuple(self.lora_names()))
        log.info("worker_ready", model=self.info.model, dtype=self.info.dtype, device=self.info.device,
                 num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, kernels=ops.name,
                 quantization=self.quantization, activation_quant=self.activation_quant, cpu_isa=cpu_kernels.active_tier() if ops.name == "cpu" else None,
                 rank=self.shard.rank, tensor_parallel_size=tp, pipeline_parallel_size=pp, task=self.task)

    def _lora_registry(self, config: WorkerConfig, model, local: ModelArchConfig, linear) -> LoraRegistry:
        """The adapters this worker holds (services/worker/lora.py), the model's LoRA sites enabled."""
        if self.shard.world_size > 1:
            raise InvalidArgument("enable_lora", "LoRA adapters are served by single-process workers only, not yet "
                                                 "by a tensor/pipeline parallel group")
        model.enable_lora(LoraState(linear))
        splits = site_splits(local.num_heads, local.num_kv_heads, local.head_dim, local.hidden_size,
                             local.intermediate_size)
        num_layers, dtype, device = local.num_layers, self.dtype, self.device

        def load(name: str, path: str):
            return load_adapter(name, path, max_rank=config.max_lora_rank, num_layers=num_layers, splits=splits,
                                dtype=dtype, device=device, pack=prepack)
        return LoraRegistry(config.max_cpu_loras, load)

    def load_lora(self, name: str, path: str):
        """Hold adapter `name` from the PEFT folder `path` (a no-op where held from that path); InvalidArgument
        naming the problem for a bad adapter. Past max_cpu_loras the least recently used idle one is dropped."""
        registry = self._registry()
        adapter = registry.load(name, path, in_use=self._loras_in_use())
        log.info("lora_loaded", lora_name=name, path=str(path), rank=adapter.rank, targets=list(adapter.target_modules))
        return adapter

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name` (the scheduler first checks that nothing runs or waits under it,
        Scheduler.retire_lora: this worker's mirrors may still hold finished sequences it was not yet told
        to forget)."""
        self._registry().unload(name)
        log.info("lora_unloaded", lora_name=name)

    def lora_names(self) -> list[str]:
        """The adapters held now (none without --enable-lora)."""
        return list(self.runner.loras.adapters) if self.runner.loras is not None else []

    def _registry(self) -> LoraRegistry:
        check(self.runner.loras is not None, "enable_lora", "this worker runs without --enable-lora")
        return self.runner.loras

    def _loras_in_use(self) -> set[str]:
        return {s.lora.name for s in self.runner.seqs.values() if s.lora is not None}

    def _join_group(self, config: WorkerConfig, cache: CacheConfig):
        """Meet the other ranks; an in-process group (no address given, rank 0) starts them itself."""
        from services.worker.group import TIMEOUT_S, GroupComm, free_address

        address = config.group_address
        if not address:
            if config.group_rank != 0:
                raise ValueError("group_address: a rank other than 0 must be told where rank 0 is")
            address = free_address()
            # the ranks share this machine's threads (num_threads, or every core): an equal part each
            self.rank_threads = max(1, (config.num_threads or os.cpu_count() or 1) // self.shard.world_size)
            context = multiprocessing.get_context("spawn")
            started = []
            for rank in range(1, self.shard.world_size):
                follower = dataclasses.replace(config, group_rank=rank, group_address=address,
                                               num_threads=self.rank_threads)
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=follow, args=(follower, cache, sender), daemon=True,
                                          name=f"pagedserve-rank-{rank}")
                process.start()
                sender.close()  # the follower holds the only sending end: its exit closes the pipe
                self.followers.append(process)
                started.append(receiver)
            self._wait_started(started, TIMEOUT_S)
        return GroupComm(self.shard, address, config.distributed_backend)

    def _wait_started(self, started: list, timeout_s: float) -> None:
        """Wait until every follower this process spawned has started (re-imported the main module and
        reached `follow`). A follower that exits first would leave rank 0 waiting at the rendezvous
        for the group's whole timeout: raise at once instead, with the usual cause and its fix."""
        pending = dict(zip(started, self.followers))
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break  # slow to start, not gone: the rendezvous's own timeout takes over
            for receiver in ready:
                process = pending.pop(receiver)
                try:
                    receiver.recv()
                except EOFError:  # it exited before it could say so
                    process.join(timeout=5)
                    self._stop_followers()
                    raise RuntimeError(
                        f"tensor_parallel_size x pipeline_parallel_size = {self.shard.world_size}: the group's rank "
                        f"process {process.name} exited with status {process.exitcode} while starting. Its ranks "
                        "are started with multiprocessing's spawn, which runs the main script again in each new "
                        "process: a script that creates an LLM with tensor_parallel_size or "
                        "pipeline_parallel_size > 1 must do so under `if __name__ == \"__main__\":` (its error, "
                        "printed above, says the same). Otherwise see that process's error above.") from None
                finally:
                    receiver.close()

    def _stop_followers(self) -> None:
        for process in self.followers:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        self.followers.clear()

    def step(self, delta: StepDelta) -> StepResult:
        if self.comm is None:
            return self.runner.execute(delta)
        if self.broken:
            raise GroupBroken("this worker group lost a rank; it is restarting")
        from services.rpc.internal_codec import delta_to_bytes
        from services.worker.group import STEP

        delta = dataclasses.replace(delta, async_next_step=False)  # the followers cannot run ahead
        try:
            self.comm.broadcast(STEP, delta_to_bytes(delta))
            return self.runner.execute(delta)
        except (InvalidArgument, UnknownSequence):  # every rank refused the same delta: the group is whole
            raise
        except Exception as error:
            self.broken = True
            log.error("worker_group_broken", rank=0, error=f"{type(error).__name__}: {error}")
            raise GroupBroken(f"this worker group lost a rank: {type(error).__name__}: {error}") from error

    def forget_all(self) -> None:
        """The scheduler dropped this worker: no sequence it holds will be named again."""
        if self.comm is not None:
            from services.worker.group import FORGET

            self.comm.broadcast(FORGET)
        self.runner.forget_all()

    def group_timers(self) -> list[dict[str, float]]:
        """Each rank's time computing and in its pipelined passes so far (rank 0 of a group; bench/parallel.py)."""
        from services.worker.group import TIMERS

        self.comm.broadcast(TIMERS)
        return self.comm.gather_timers()

    def close(self) -> None:
        """Stop the followers (rank 0 of a group); a no-op for a single process."""
        if self.comm is not None and self.shard.rank == 0:
            from services.worker.group import STOP

            try:
                self.comm.broadcast(STOP)
            except Exception:  # noqa: BLE001 - a follower already gone: the group is over anyway
                pass
        for process in self.followers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self.followers.clear()
        if self.comm is not None:
            self.comm.close()

    def follow(self) -> None:
        """A rank other than 0: run each step rank 0 broadcasts, until it says stop or the group breaks."""
        from services.rpc.internal_codec import delta_from_bytes
        from services.worker.group import FORGET, STEP, TIMERS

        while True:
            kind, payload = self.comm.receive()
            if kind == FORGET:
                self.runner.forget_all()
            elif kind == TIMERS:
                self.comm.gather_timers()
            elif kind == STEP:
                try:
                    self.runner.execute(delta_from_bytes(payload))
                except (ValueError, LookupError) as error:  # the same refusal rank 0 answers with
                    log.info("follower_step_refused", rank=self.shard.rank, error=str(error))
            else:
                return

    def run_async_step(self) -> None:
        """Run the continuation the last step announced (async scheduling, StepDelta.async_next_step)
        while its result travels. A failure only costs the head start: the next delta then runs as usual."""
        if self.comm is not None:
            return  # a group runs no step ahead: its followers see only the deltas
        try:
            self.runner.run_async_step()
        except Exception:  # noqa: BLE001 - never fatal: nothing was committed
            log.exception("async_step_failed")


def follow(config: WorkerConfig, cache: CacheConfig, started=None) -> None:
    """A follower rank's process: load the shard, join the group, run rank 0's steps until told to stop.
    A broken group (rank 0 or another rank gone) ends it with an error: the launcher restarts the group.
    `started` (the sending end of a pipe, from the rank 0 that spawned it) is told first thing that this
    process got through its start-up (Worker._wait_started)."""
    if started is not None:
        started.send(True)
        started.close()
    worker = Worker(config, cache)
    try:
        worker.follow()
    finally:
        worker.comm.close()
