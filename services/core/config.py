"""Engine configuration: one dataclass per concern, validated when built.

Names follow vLLM's engine arguments where the idea is the same. Nothing here reads
the environment; each service's `main` builds these from flags.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from services.core.errors import InvalidArgument, check

ALLOWED_BLOCK_SIZES = (8, 16, 32)
POLICIES = ("fcfs", "priority", "sjf")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("float32", "bfloat16", "float16", "auto")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")
CPU_ISAS = ("auto", "avx512", "avx2", "generic")  # the CPU kernels' tiers (kernels.cpu_kernels.TIERS)
# auto: gguf where the model folder holds a GGUF file (the default model), else none
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None  # explicit KV cache size in blocks, or
    kv_cache_memory_bytes: int | None = None  # a budget the worker turns into blocks
    swap_space_bytes: int = 64 << 20  # CPU swap pool per worker
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check(self.block_size in ALLOWED_BLOCK_SIZES, "block_size",
              f"must be one of {ALLOWED_BLOCK_SIZES}, got {self.block_size}")
        check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks",
              f"must be >= 1, got {self.num_gpu_blocks}")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
              f"must be > 0, got {self.kv_cache_memory_bytes}")
        check(self.swap_space_bytes >= 0, "swap_space_bytes", f"must be >= 0, got {self.swap_space_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 4096  # beyond this, new requests are refused (RESOURCE_EXHAUSTED)
    seed: int | None = None  # draws the seeds of requests that bring none; None: fresh random seeds
    # plan a worker's next step while it runs this one, so it can run it while the result
    # travels (services/core/async_scheduling.py). Worth it across processes, not in one.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
              f"must be >= 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len >= 2, "max_model_len", f"must be >= 2, got {self.max_model_len}")
        check(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
              "max_num_batched_tokens", "must be >= max_model_len when chunked prefill is off")
        check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
              f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        check(self.scheduling_policy in POLICIES, "scheduling_policy",
              f"must be one of {POLICIES}, got {self.scheduling_policy!r}")
        check(self.max_waiting_requests >= 1, "max_waiting_requests", "must be >= 1")


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    dtype: str = "auto"  # auto: the checkpoint's dtype (fp16 becomes bf16 on the CPU)
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    kernel_backend: str = "auto"  # auto: triton on cuda, else cpu (compiled kernels) if they build, else torch
    batch_invariant: bool = True  # the deterministic mode (DESIGN rule 4)
    enforce_eager: bool = False  # reserved for CUDA-graph capture, not built yet: every step runs eagerly
    num_threads: int = 0  # CPU threads for the worker's math (0: the library default)
    quantization: str = "auto"  # the weights' format: see QUANTIZATIONS and services/worker/loader.py
    cpu_isa: str = "auto"  # the CPU kernels' tier; auto: the best this CPU executes

    def __post_init__(self) -> None:
        check(bool(self.model), "model", "must name a model folder or hub id")
        check(self.quantization in QUANTIZATIONS, "quantization",
              f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check(self.cpu_isa in CPU_ISAS, "cpu_isa", f"must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        check(self.num_threads >= 0, "num_threads", f"must be >= 0, got {self.num_threads}")
        check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        check(self.device in ("auto", "cpu", "cuda"), "device", f"must be auto, cpu or cuda, got {self.device!r}")
        check(self.kernel_backend in KERNEL_BACKENDS, "kernel_backend",
              f"must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")


@dataclass(frozen=True)
class EngineArgs:
    """The flat argument set users pass to `LLM(...)` and the services' flags."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space_bytes: int = 64 << 20
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own limit (capped at 4096)
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 4096
    kernel_backend: str = "auto"
    batch_invariant: bool = True
    enforce_eager: bool = False  # no effect yet (no CUDA-graph capture); see WorkerConfig
    num_threads: int = 0
    quantization: str = "auto"
    cpu_isa: str = "auto"  # see WorkerConfig

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise InvalidArgument(name, "unknown engine argument")
        return cls(model=model, **kwargs)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_gpu_blocks, self.kv_cache_memory_bytes,
                           self.swap_space_bytes, self.enable_prefix_caching)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_len = self.max_model_len or min(model_max_len, 4096)
        check(max_len <= model_max_len, "max_model_len",
              f"{max_len} exceeds the model's max_position_embeddings {model_max_len}")
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_len,
                               self.enable_chunked_prefill, self.preemption_mode, self.scheduling_policy,
                               self.max_waiting_requests, self.seed)

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(self.model, self.dtype, self.device, self.seed, self.kernel_backend,
                            self.batch_invariant, self.enforce_eager, self.num_threads, self.quantization,
                            self.cpu_isa)
