"""python -m services.tools.gpu_compile: every Triton kernel the worker can launch, compiled ahead of
time for NVIDIA GPUs, on a machine with none.

    python -m services.tools.gpu_compile --arch sm_90,sm_80 [--subset suite] [--jobs N] [--out FILE.md]

Which kernels, with which signatures and constants, is decided by the worker's own code, not listed
here: for each model shape (a public checkpoint of each supported family, the default model, and the
make_model presets gpu_check.sh runs), each dtype (float32, bfloat16, float16) and each block size
(8, 16, 32), the tool builds a one-layer model on the meta device with the Triton kernel set and the
worker's KVCache, and runs one step of a mixed batch (a prefill chunk and two decode tokens). The
wrappers in kernels/triton_*.py check and allocate as they do on a GPU and hand their Launch to a
recorder (kernels.triton_common.recorded_launches). Each distinct launch, as Triton's JIT would
specialise it (argument types, 16-byte divisibility, constants, compile options), is compiled with
triton.compile for each architecture, in worker processes, and ptxas's resource report is read back.

Prints a table per kernel (registers, shared memory, spills, warps, cubin size, fma instructions in
the PTX), then `N kernels compiled for sm_XX` per architecture. Exit status 1 if any compile fails or a
kernel needs more shared memory than the architecture gives one block; 2 on bad arguments. The
interpreter cannot compile: TRITON_INTERPRET is dropped from this process's environment before triton
is imported (run it as its own process, not inside the kernel tests).
"""
from __future__ import annotations

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("gpu_compile needs a process without TRITON_INTERPRET=1 (triton is already imported)")
os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from services.core.config import ALLOWED_BLOCK_SIZES  # noqa: E402

# (name, model_type, hidden, heads, KV heads, head_dim, intermediate), from the checkpoints' config.json
FAMILY_SHAPES = (
    ("Llama-3.2-1B", "llama", 2048, 32, 8, 64, 8192),
    ("Llama-3.2-3B", "llama", 3072, 24, 8, 128, 8192),
    ("Llama-3.1-8B", "llama", 4096, 32, 8, 128, 14336),
    ("Llama-3.1-70B", "llama", 8192, 64, 8, 128, 28672),
    ("Mistral-7B-v0.3", "mistral", 4096, 32, 8, 128, 14336),
    ("Qwen2.5-0.5B", "qwen2", 896, 14, 2, 64, 4864),
    ("Qwen2.5-7B", "qwen2", 3584, 28, 4, 128, 18944),
    ("Qwen3-0.6B", "qwen3", 1024, 16, 8, 128, 3072),
    ("Qwen3-8B", "qwen3", 4096, 32, 8, 128, 12288),
    ("SmolLM2-135M", "llama", 576, 9, 3, 64, 1536),  # the default model
)
MAKE_MODEL_PRESETS = (("llama", "tiny"), ("qwen3", "tiny"), ("llama", "1b"))  # what gpu_check.sh runs
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the suite's subset (--subset suite): every kernel, dtype and block size, the head dims 64 and 128,
# q/k norm, the default model; (model, dtype, block sizes), fp32 once (its attention compiles slowly)
SUITE_RUNS = (("SmolLM2-135M", torch.float32, (16,)), ("SmolLM2-135M", torch.bfloat16, ALLOWED_BLOCK_SIZES),
              ("Qwen3-0.6B", torch.bfloat16, (16,)), ("Qwen3-0.6B", torch.float16, (16,)))
# the most shared memory one block may use (bytes, with the opt-in carve-out): CUDA's per-arch limits
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True, kw_only=True)
class Job:
    """One kernel variant for one architecture, as triton.compile takes it (picklable)."""

    module: str
    kernel: str
    capability: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict  # the launch's keyword options (enable_fp_fusion, debug, ...)
    label: str  # the variant's dtypes and constants, for the table
    used_by: tuple[str, ...]  # model / dtype / block size combinations that launch it


@dataclass(frozen=True, kw_only=True)
class Result:
    job: Job
    error: str | None = None
    registers: int = 0
    shared: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    num_warps: int = 0
    cubin_bytes: int = 0
    ptx_fma: int = 0  # fp32 fused multiply-adds in the PTX: tl.dot on FMA units only (FP_FUSION is off)
    seconds: float = 0.0


def model_configs(subset: str | None) -> dict[str, dict]:
    """name -> HF config.json dict of every model shape compiled for."""
    from services.tools.make_model import SIZES, model_config

    configs = {}
    for name, model_type, hidden, heads, kv_heads, head_dim, inter in FAMILY_SHAPES:
        if subset and name not in {run[0] for run in SUITE_RUNS}:
            continue
        configs[name] = dict(model_type=model_type, hidden_size=hidden, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
                             num_hidden_layers=1, vocab_size=256, max_position_embeddings=4096)
    for arch, size in () if subset else MAKE_MODEL_PRESETS:
        configs[f"make_model {arch} {size}"] = model_config(arch, SIZES[size]) | dict(
            num_hidden_layers=1, vocab_size=256, max_position_embeddings=4096)
    return configs


MIXED_STEP = ((20, 20), (300, 1), (17, 1))  # a prefill chunk of 20 tokens, decode tokens at contexts 300 and 17


def record_step(raw_config: dict, dtype: torch.dtype, block_size: int, seqs=MIXED_STEP) -> list:
    """The launches of one worker step on the Triton kernels, every tensor on the meta device.
    seqs: per sequence, (context length after the step, tokens it runs in the step)."""
    from kernels.linear import plain_linear
    from kernels.triton_common import recorded_launches
    from kernels.triton_ops import TRITON_OPS
    from services.worker.kv_cache import KVCache
    from services.worker.model_config import ModelArchConfig
    from services.worker.models.llama import AttentionMetadata, LlamaForCausalLM

    meta = torch.device("meta")
    cfg = ModelArchConfig.from_dict(raw_config)
    with meta:
        model = LlamaForCausalLM(cfg, TRITON_OPS, plain_linear)
    model = model.to(dtype=dtype)  # as services.worker.loader.load_model does
    cache = KVCache(cfg, num_blocks=64, num_cpu_blocks=0, block_size=block_size, dtype=dtype, device=meta)
    seq_lens, num_queries = [n for n, _ in seqs], [q for _, q in seqs]
    num_tokens, width = sum(num_queries), -(-max(seq_lens) // block_size)

    def ints(*shape: int) -> torch.Tensor:  # the runner's metadata: int64 (ModelRunner._tensors)
        return torch.empty(shape, dtype=torch.int64, device=meta)

    positions = ints(num_tokens)
    attn = AttentionMetadata(positions=positions, slot_mapping=ints(num_tokens), block_tables=ints(len(seq_lens), width),
                             seq_lens=ints(len(seq_lens)), query_start_loc=ints(len(seq_lens) + 1),
                             layout=(ints(num_tokens), positions))
    with recorded_launches() as launches:
        model(ints(num_tokens), cache.layers, attn)
    return launches


def specialise(launch, capability: int) -> tuple[tuple, Job]:
    """What Triton's JIT does at a launch, up to the compile: bind the arguments, specialise them
    (types, divisibility by 16, ints equal to 1) and parse the options, here for a chosen target."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", capability, 32))
    kwargs = {**launch.constexprs, **launch.options, "debug": kernel.debug or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode,
              "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts}  # as JITFunction.run adds
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    _, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    pointers = sorted({t for t in signature.values() if t.startswith("*")})
    label = ", ".join(pointers + [f"{k}={v}" for k, v in launch.constexprs.items()])
    job = Job(module=kernel.fn.__module__, kernel=kernel.fn.__name__, capability=capability, signature=signature,
              constexprs=constexprs, attrs=attrs, options=kwargs, label=label, used_by=())
    return (launch.name, key), job


def plan(capabilities: list[int], subset: str | None) -> list[Job]:
    """Every distinct kernel variant the worker launches, once per architecture."""
    variants: dict[tuple, Job] = {}
    users: dict[tuple, list[str]] = {}
    configs = model_configs(subset)
    runs = [run for run in SUITE_RUNS if run[0] in configs] if subset else \
        [(name, dtype, ALLOWED_BLOCK_SIZES) for name in configs for dtype in DTYPES]
    for name, dtype, block_sizes in runs:
        for block_size in block_sizes:
            for launch in record_step(configs[name], dtype, block_size):
                for capability in capabilities:
                    key, job = specialise(launch, capability)
                    variants.setdefault((capability, key), job)
                    use = f"{name}/{str(dtype).removeprefix('torch.')}/bs{block_size}"
                    users.setdefault((capability, key), []).append(use)
    return [Job(**{**job.__dict__, "used_by": tuple(dict.fromkeys(users[k]))}) for k, job in variants.items()]


def compile_job(job: Job) -> Result:
    """triton.compile for the job's target, with ptxas's -v report captured (runs in a worker process)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = getattr(importlib.import_module(job.module), job.kernel)
    target = GPUTarget("cuda", job.capability, 32)
    options = make_backend(target).parse_options(job.options)
    knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas's -v output, which lands in `log`
    log, start = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, job.signature, job.constexprs, job.attrs), target=target,
                                      options=options.__dict__)
    except Exception as error:  # noqa: BLE001 - reported in the table, the run fails
        return Result(job=job, error=f"{type(error).__name__}: {error}"[-3000:])
    report = log.getvalue()
    used, spills = _PTXAS_USED.search(report), _PTXAS_SPILLS.search(report)
    return Result(job=job, registers=int(used.group(1)) if used else -1, shared=compiled.metadata.shared,
                  spill_stores=int(spills.group(1)) if spills else -1, spill_loads=int(spills.group(2)) if spills else -1,
                  num_warps=compiled.metadata.num_warps, cubin_bytes=len(compiled.asm["cubin"]),
                  ptx_fma=compiled.asm["ptx"].count("fma.rn.f32"), seconds=time.perf_counter() - start)


def compile_all(jobs: list[Job], workers: int) -> list[Result]:
    """Compiles in `workers` fresh processes (spawned: no torch/triton state forked), each with an empty
    Triton cache so ptxas runs and reports every time."""
    with tempfile.TemporaryDirectory(prefix="gpu_compile_cache_") as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            return list(pool.map(compile_job, jobs))


def problems(result: Result) -> list[str]:
    if result.error:
        return [result.error]
    limit = MAX_SHARED.get(result.job.capability)
    if limit is not None and result.shared > limit:
        return [f"needs {result.shared} bytes of shared memory, sm_{result.job.capability} gives a block {limit}"]
    return []


def report(results: list[Result], capabilities: list[int], seconds: float) -> list[str]:
    """Markdown: a table per kernel and architecture, the failures, and the closing counts."""
    lines = []
    for capability in capabilities:
        mine = [r for r in results if r.job.capability == capability]
        for kernel in sorted({r.job.kernel for r in mine}):
            lines += [f"### {kernel}, sm_{capability}", "",
                      "| variant | registers | shared B | spill st/ld B | warps | cubin B | fp32 fma | s | launched by |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in sorted((r for r in mine if r.job.kernel == kernel), key=lambda r: r.job.label):
                users = ", ".join(r.job.used_by[:3]) + (f" +{len(r.job.used_by) - 3}" if len(r.job.used_by) > 3 else "")
                if r.error:
                    lines.append(f"| {r.job.label} | FAILED | | | | | | | {users} |")
                else:
                    lines.append(f"| {r.job.label} | {r.registers} | {r.shared} | {r.spill_stores}/{r.spill_loads} | "
                                 f"{r.num_warps} | {r.cubin_bytes} | {r.ptx_fma} | {r.seconds:.1f} | {users} |")
            lines.append("")
    failed = [(r, p) for r in results for p in problems(r)]
    for r, problem in failed:
        lines += [f"FAILED {r.job.kernel} sm_{r.job.capability} [{r.job.label}]:", "", "```", problem, "```", ""]
    spilled = sum(1 for r in results if not r.error and (r.spill_stores or r.spill_loads))
    lines.append(f"{spilled} variants spill registers" if spilled else "no variant spills registers")
    lines.append(f"compiled in {seconds:.0f} s")
    for capability in capabilities:
        ok = sum(1 for r in results if r.job.capability == capability and not problems(r))
        lines.append(f"{ok} kernels compiled for sm_{capability}")
    return lines


def parse_arch(text: str) -> list[int]:
    capabilities = []
    for part in text.split(","):
        match = re.fullmatch(r"sm_(\d+)", part.strip())
        if not match or int(match.group(1)) not in MAX_SHARED:
            raise argparse.ArgumentTypeError(f"--arch: {part!r} is not one of {', '.join(f'sm_{c}' for c in MAX_SHARED)}")
        capabilities.append(int(match.group(1)))
    return capabilities


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.tools.gpu_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=parse_arch, default=parse_arch("sm_90,sm_80"), help="e.g. sm_90,sm_80")
    parser.add_argument("--subset", choices=["suite"], help="the test suite's subset: %s" % ", ".join(
        f"{name} {str(dtype).removeprefix('torch.')} block sizes {sizes}" for name, dtype, sizes in SUITE_RUNS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    parser.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = parser.parse_args(argv)
    start, load_before = time.perf_counter(), os.getloadavg()
    jobs = plan(args.arch, args.subset)
    print(f"{len(jobs)} kernel variants to compile ({', '.join(f'sm_{c}' for c in args.arch)}), "
          f"{args.jobs} processes", flush=True)
    results = compile_all(jobs, max(1, args.jobs))
    lines = report(results, args.arch, time.perf_counter() - start)
    print("\n".join(lines))
    if args.out:
        import triton

        header = [f"# Triton kernels compiled ahead of time ({', '.join(f'sm_{c}' for c in args.arch)})", "",
                  f"`python -m services.tools.gpu_compile {' '.join(argv if argv is not None else sys.argv[1:])}`, "
                  f"Triton {triton.__version__}, {args.jobs} compiler processes, load average before "
                  f"{load_before[0]:.1f} and after {os.getloadavg()[0]:.1f} (a shared host: the seconds are wall "
                  "time under that load).", "",
                  "Registers and spills: ptxas -v; shared: the bytes Triton asks for at launch; fp32 fma: "
                  "`fma.rn.f32` in the PTX (contraction is off: only tl.dot on FMA units makes them).", ""]
        args.out.write_text("\n".join(header + lines) + "\n")
    return 1 if any(problems(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
