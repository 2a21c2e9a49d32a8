"""Today's features on a GPU worker, each checked for what a user notices (tokens, logprobs, statuses).
bench/gpu_check.sh runs it on a lent GPU; on a CPU it checks the script itself.

    python bench/gpu_features.py [--device cuda] [--dtype bfloat16] [--sections sample,devices,...]
    python bench/gpu_features.py --device cpu --dtype float32 --kernel-backend torch   # the script, on a CPU

Sections (a tiny random-weight Llama from make_model; seeded sampling at temperature 0.8 unless said):
  sample      the same tokens twice, and alone as in a batch of 8
  devices     --device cuda:N on the last GPU gives the tokens of cuda:0 (skipped with fewer than two GPUs)
  backends    each kernel backend the device runs (cuda: triton, torch; cpu: cpu, torch): alone == batched
              per backend; whether two backends agree is reported, not required (other reduction orders)
  async       async scheduling (the worker runs the announced continuation early, as the worker service
              does): the tokens and logprobs of plain steps
  structured  JSON-schema, regex and choice constraints at temperature 1: every output valid; alone == batched
  quant       on a GPU, quantization auto on a folder holding a GGUF serves the dense weights and int8 is
              refused naming quantization; on a CPU, int8 serves and is batch-invariant
  aot         every Triton kernel variant this process's JIT compiled is one services.tools.gpu_compile
              planned for the device's architecture (skipped when no Triton kernel ran)
Writes bench/results/gpu_features.md (and .json); exit status 1 if a section fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import loadavg, markdown_table, write_results  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from services.core.errors import InvalidArgument  # noqa: E402
from services.tools.make_model import make_model  # noqa: E402

SECTIONS = ("sample", "devices", "backends", "async", "structured", "quant", "aot")
PROMPTS = [[5, 17, 42, 9], [7, 8, 9], [100, 3, 3, 3, 3, 64], [11] * 40, [300, 301], [12, 13, 14, 15, 16],
           [400] * 17, [9, 8, 7, 6]]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"


def sampled(i: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 3 + i, "max_tokens": 16,
                             "ignore_eos": True, "logprobs": 1, **kw})


def outputs(llm: LLM, prompts, params) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def alone_vs_batched(llm: LLM, params=None) -> bool:
    params = params or [sampled(i) for i in range(len(PROMPTS))]
    batch = outputs(llm, PROMPTS, params)
    return all(outputs(llm, [p], [q])[0] == b for p, q, b in zip(PROMPTS[:3], params[:3], batch[:3]))


def check_sample(ctx) -> str:
    llm = ctx.llm()
    one, again = outputs(llm, PROMPTS[:1], [sampled(0)]), outputs(llm, PROMPTS[:1], [sampled(0)])
    assert one == again, "the same request twice gave other tokens"
    assert alone_vs_batched(llm), "alone != in a batch of 8"
    return f"tokens {one[0][0]}"


def check_devices(ctx) -> str:
    count = torch.cuda.device_count() if ctx.device.startswith("cuda") else 0
    if count < 2:
        return "skipped: fewer than two GPUs"
    first = outputs(ctx.llm(device="cuda:0"), PROMPTS, [sampled(i) for i in range(len(PROMPTS))])
    last = outputs(ctx.llm(device=f"cuda:{count - 1}"), PROMPTS, [sampled(i) for i in range(len(PROMPTS))])
    assert first == last, f"cuda:{count - 1} gave other tokens than cuda:0"
    return f"cuda:0 and cuda:{count - 1}: the same tokens"


def check_backends(ctx) -> str:
    backends = ("triton", "torch") if ctx.device.startswith("cuda") else ("cpu", "torch")
    results = {}
    for backend in backends:
        llm = ctx.llm(kernel_backend=backend)
        assert alone_vs_batched(llm), f"{backend}: alone != batched"
        results[backend] = outputs(llm, PROMPTS, [sampled(i) for i in range(len(PROMPTS))])
    agree = results[backends[0]] == results[backends[1]]
    return f"{' and '.join(backends)} each batch-invariant; they {'agree' if agree else 'differ'} in bits"


def check_async(ctx) -> str:
    from services.core.config import EngineArgs
    from services.core.scheduler import Scheduler
    from services.worker.worker import Worker

    args = EngineArgs.from_kwargs(str(ctx.folder), **ctx.engine_kwargs())
    worker = Worker(args.worker_config(), args.cache_config())
    sched = Scheduler(dataclasses.replace(args.scheduler_config(worker.info.max_model_len), async_scheduling=True))
    sched.add_worker("w", worker.info)
    params = [sampled(i, max_tokens=6 + 2 * i) for i in range(len(PROMPTS))]  # ending at different steps
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        sched.add_request(f"r{i}", prompt, p)
    got: dict[str, tuple[list, list]] = {}
    while sched.has_unfinished():  # as the worker service drives it: step, then the continuation early
        for worker_id, delta in sched.schedule().items():
            result = worker.step(delta)
            if delta.async_next_step:
                worker.run_async_step()
            for update in sched.update(worker_id, result):
                ids, lps = got.setdefault(update.request_id, ([], []))
                ids += update.token_ids
                lps += update.logprobs or []
    want = outputs(ctx.llm(), PROMPTS, params)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == [(ids, lps) for ids, lps in want], "async != plain steps"
    steps = worker.runner.async_steps
    assert steps.num_used > 0, "no continuation was used"
    return f"same tokens and logprobs; {steps.num_used} of {steps.num_run} early steps used"


def check_structured(ctx) -> str:
    import jsonschema

    llm = ctx.llm()
    kinds = [{"json": PERSON}, {"regex": EMAIL}, {"choice": ["alpha", "beta", "gamma"]}]
    params = [sampled(i, temperature=1.0, max_tokens=60, ignore_eos=False, structured_outputs=kinds[i % 3])
              for i in range(len(PROMPTS))]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.finish_reason, out.text)
        if i % 3 == 0:
            jsonschema.validate(json.loads(out.text), PERSON)
        elif i % 3 == 1:
            assert re.fullmatch(EMAIL, out.text), out.text
        else:
            assert out.text in ("alpha", "beta", "gamma"), out.text
    assert alone_vs_batched(llm, params), "constrained: alone != batched"
    return f"{len(outs)} valid outputs (json, regex, choice); alone == batched"


def check_quant(ctx) -> str:
    if ctx.device == "cpu":
        assert alone_vs_batched(ctx.llm(quantization="int8")), "int8: alone != batched"
        return "cpu: int8 serves, batch-invariant"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(ctx.folder, Path(tmp) / "model"))
        (folder / "model.Q4_1.gguf").write_bytes(b"")  # never read on a GPU: auto means none there
        dense = outputs(ctx.llm(folder=folder, quantization="auto"), PROMPTS, [sampled(i) for i in range(8)])
    assert dense == outputs(ctx.llm(quantization="none"), PROMPTS, [sampled(i) for i in range(8)])
    try:
        ctx.llm(quantization="int8")
    except InvalidArgument as refused:
        assert refused.field == "quantization", refused
        return "auto serves the dense weights beside a GGUF; int8 refused naming quantization"
    raise AssertionError("int8 on a GPU was not refused")


def check_aot(ctx) -> str:
    from kernels import triton_activation, triton_attention, triton_cache, triton_norm, triton_rotary
    from services.tools import gpu_compile

    kernels = [triton_attention._paged_attention_kernel, triton_cache._write_kv_kernel, triton_norm._rms_norm_kernel,
               triton_rotary._rotary_kernel, triton_activation._silu_and_mul_kernel]
    compiled = {(k.fn.__name__, key) for k in kernels for caches in getattr(k, "device_caches", {}).values()
                for key in caches[0]}
    if not compiled:
        return "skipped: no Triton kernel was compiled in this process"
    major, minor = torch.cuda.get_device_capability()
    raw = json.loads((ctx.folder / "config.json").read_text()) | {"num_hidden_layers": 1}
    planned = {gpu_compile.specialise(launch, 10 * major + minor)[0]
               for dtype in (ctx.dtype,) for block_size in (16,)
               for launch in gpu_compile.record_step(raw, dtype, block_size)}
    missing = compiled - planned
    assert not missing, f"compiled by the JIT, not planned ahead of time: {sorted(name for name, _ in missing)}"
    return f"all {len(compiled)} JIT-compiled variants were planned by gpu_compile"


@dataclasses.dataclass
class Context:
    folder: Path
    device: str
    dtype: torch.dtype
    kernel_backend: str

    def engine_kwargs(self, **kw) -> dict:
        base = dict(device=self.device, dtype=str(self.dtype).removeprefix("torch."), kernel_backend=self.kernel_backend,
                    seed=0, num_gpu_blocks=256)
        return base | kw

    def llm(self, folder: Path | None = None, **kw) -> LLM:
        return LLM(str(folder or self.folder), **self.engine_kwargs(**kw))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", default="gpu_features", help="results stem under bench/results")
    args = parser.parse_args()
    load_before = loadavg()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(make_model(Path(tmp) / "tiny", arch="llama", size="tiny", seed=0))
        ctx = Context(folder, args.device, getattr(torch, args.dtype), args.kernel_backend)
        for name in args.sections.split(","):
            try:
                rows.append([name, "pass", globals()[f"check_{name}"](ctx)])
            except Exception as error:  # noqa: BLE001 - one section's failure is its row, the others still run
                traceback.print_exc()
                rows.append([name, "FAIL", f"{type(error).__name__}: {error}"[:300]])
                ok = False
            print(" | ".join(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    body = f"Device: {device}; dtype {args.dtype}; kernel backend {args.kernel_backend}.\n\n"
    write_results(args.out, "GPU features", load_before, body + markdown_table(["section", "result", "detail"], rows),
                  {"device": device, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
