"""A worker: the weights, the KV cache and the step. Plain class; the gRPC servicer wraps it."""
from __future__ import annotations

import torch
import structlog

from kernels import cpu_kernels
from kernels.ops import get_ops
from services.core.config import CacheConfig, WorkerConfig
from services.core.errors import InvalidArgument
from services.core.model_path import resolve_model_path
from services.core.step import StepDelta, StepResult, WorkerInfo
from services.worker.kv_cache import KVCache, block_bytes, num_blocks_for
from kernels.linear import invariant_linear, plain_linear
from services.worker.loader import load_model, resolve_dtype, resolve_quantization
from services.worker.model_config import ModelArchConfig
from services.worker.grammar import Grammars
from services.worker.model_runner import ModelRunner

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


class Worker:
    def __init__(self, config: WorkerConfig, cache: CacheConfig):
        self.config = config
        self.device = pick_device(config.device)
        self.model_path = resolve_model_path(config.model)
        arch = ModelArchConfig.from_folder(self.model_path)
        self.dtype = resolve_dtype(config.dtype, arch, self.device)
        torch.manual_seed(config.seed)
        if config.num_threads:  # several workers on one machine must not oversubscribe its cores
            torch.set_num_threads(config.num_threads)
        ops = get_ops(config.kernel_backend, self.device.type, config.cpu_isa)
        linear = invariant_linear if config.batch_invariant else plain_linear
        self.quantization = resolve_quantization(config.quantization, self.model_path, self.device.type)
        model = load_model(self.model_path, self.dtype, self.device, ops, linear, self.quantization)
        num_blocks = num_blocks_for(arch, cache.block_size, self.dtype, self.device, cache.num_gpu_blocks,
                                    cache.kv_cache_memory_bytes)
        num_cpu_blocks = cache.swap_space_bytes // block_bytes(arch, cache.block_size, self.dtype)
        kv_cache = KVCache(arch, num_blocks, num_cpu_blocks, cache.block_size, self.dtype, self.device)
        grammars = Grammars(self.model_path, arch.vocab_size, arch.eos_token_ids)
        self.runner = ModelRunner(model, kv_cache, self.device, config.batch_invariant, grammars)
        self.info = WorkerInfo(
            model=str(self.model_path), dtype=str(self.dtype).removeprefix("torch."), block_size=cache.block_size,
            num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, vocab_size=arch.vocab_size,
            max_model_len=arch.max_position_embeddings, eos_token_ids=arch.eos_token_ids,
            device=self.device.type, batch_invariant=config.batch_invariant)
        log.info("worker_ready", model=self.info.model, dtype=self.info.dtype, device=self.info.device,
                 num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, kernels=ops.name,
                 quantization=self.quantization, cpu_isa=cpu_kernels.active_tier() if ops.name == "cpu" else None)

    def step(self, delta: StepDelta) -> StepResult:
        return self.runner.execute(delta)

    def run_async_step(self) -> None:
        """Run the continuation the last step announced (async scheduling, StepDelta.async_next_step)
        while its result travels. A failure only costs the head start: the next delta then runs as usual."""
        try:
            self.runner.run_async_step()
        except Exception:  # noqa: BLE001 - never fatal: nothing was committed
            log.exception("async_step_failed")
