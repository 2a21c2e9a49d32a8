"""Embedding throughput (tokens/s): pagedserve's LLM.embed against sentence-transformers' own batched
encode, on the same random-weight BERT (make_model --arch bert, with its sentence-transformers layout)
and the same texts, in fp32, interleaved round by round so a burst of load hits both alike; with
--llama-cpp-dir also against llama.cpp's `llama-server --embeddings` on the same GGUF file.

The claim it measures (issue 43): serving embeddings through pagedserve's engine costs no more than
embedding with the library users embed with, or with llama.cpp. Each contender embeds the whole set once
per round; the table gives the median tokens/s over the rounds (prompt tokens as the model's tokenizer
counts them, special tokens included) and the cosine between the sets of vectors (parity, not speed).

    .venv/bin/python bench/embed.py [--size bench] [--num-texts 256] [--rounds 3] [--batch-size 32] [--threads 0]
    .venv/bin/python bench/embed.py ... --llama-cpp-dir LLAMA_CPP_BIN --llama-cpp-convert CONVERT_HF_TO_GGUF \
        [--gguf-type f32]

With llama.cpp the model is `bert_wordpiece` (BERT's kind of vocabulary, which llama.cpp's tokenizer
reads), converted by llama.cpp's own converter (CONVERT_HF_TO_GGUF: convert_hf_to_gguf.py, or a wrapper
that names the random-weight vocabulary's pre-tokenizer, which it cannot recognise by hash) to
--gguf-type; LLM.embed then serves that file (`--model x.gguf`), sentence-transformers the folder, and
llama-server the file with one slot per 512 tokens of context.

A figure only means something on a quiet host (the load average is in the results file's header).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp  # noqa: E402
from bench.common import loadavg, markdown_table, write_results  # noqa: E402
from services.tools.make_model import make_model  # noqa: E402

WORDS = ("the scheduler places each request on a worker holding its longest cached prefix while blocks "
         "are freed when a request finishes and the frontend checks every parameter before it runs").split()


def texts(num: int, seed: int = 0) -> list[str]:
    """Sentences of 8 to 120 words, a retrieval corpus's spread of lengths."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(num)]


def main() -> None:
    args = _parser().parse_args()
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM

    server_bin, skipped = llamacpp.binary(args.llama_cpp_dir, "llama-server") if args.llama_cpp_dir or \
        args.llama_cpp_convert else (None, None)
    if server_bin is not None and not args.llama_cpp_convert:
        server_bin, skipped = None, "llama-server: give --llama-cpp-convert (llama.cpp's convert_hf_to_gguf.py)"
    arch = args.arch if args.arch != "auto" else "bert_wordpiece" if server_bin else "bert"
    threads = args.threads or os.cpu_count()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = loadavg()
    corpus = texts(args.num_texts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "bert", arch=arch, size=args.size, seed=0)
        model = convert(args.llama_cpp_convert, folder, Path(tmp), args.gguf_type) if server_bin else folder
        llm = LLM(str(model), dtype="float32", num_threads=args.threads,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256)
        st = SentenceTransformer(str(folder), device="cpu")
        num_tokens = sum(len(llm.tokenizer.encode_pooling(t)) for t in corpus)
        names = {"ours": "pagedserve LLM.embed" + (f" (GGUF {args.gguf_type.upper()})" if server_bin else ""),
                 "st": "sentence-transformers encode",
                 "llama": f"llama-server --embeddings (GGUF {args.gguf_type.upper()})"}
        seconds = {key: [] for key in (("ours", "st", "llama") if server_bin else ("ours", "st"))}
        vectors, llama_tokens = {}, None
        server = llamacpp.Server(server_bin, model, threads, slots=args.slots, ctx_per_slot=512,
                                 extra_args=("--embeddings", "-b", "4096", "-ub", "4096")) if server_bin else None
        try:
            for _ in range(args.rounds):
                start = time.perf_counter()
                vectors["ours"] = [o.outputs.embedding for o in llm.embed(corpus, use_tqdm=False)]
                seconds["ours"].append(time.perf_counter() - start)
                start = time.perf_counter()
                vectors["st"] = st.encode(corpus, batch_size=args.batch_size, convert_to_numpy=True)
                seconds["st"].append(time.perf_counter() - start)
                if server is not None:
                    start = time.perf_counter()
                    vectors["llama"], llama_tokens = server.embed(corpus)
                    seconds["llama"].append(time.perf_counter() - start)
        finally:
            if server is not None:
                server.close()
    ours = np.asarray(vectors["ours"])
    cosines = {key: _min_cosine(ours, np.asarray(vectors[key])) for key in seconds if key != "ours"}
    rates = {key: num_tokens / statistics.median(s) for key, s in seconds.items()}
    rows = [[names[key], f"{rates[key]:.0f}", f"{statistics.median(s):.2f}", f"{min(s):.2f}"]
            for key, s in seconds.items()]
    ratios = {key: rates["ours"] / rates[key] for key in cosines}
    body = (f"make_model --arch {arch} --size {args.size}, fp32"
            + (f", converted by llama.cpp's converter to {args.gguf_type.upper()}" if server_bin else "")
            + f"; {args.num_texts} texts, {num_tokens} tokens"
            + (f" (llama-server counted {llama_tokens})" if llama_tokens is not None else "")
            + f"; {args.rounds} rounds, interleaved; sentence-transformers batch size {args.batch_size}; "
              f"torch threads {args.threads or 'default'}"
            + (f"; llama-server -t {threads}, {args.slots} slots" if server_bin else "") + "\n\n"
            + markdown_table(["contender", "tokens/s (median)", "s per round (median)", "s (fastest)"], rows) + "\n"
            + "".join(f"pagedserve / {names[key]}: {ratios[key]:.2f}x; lowest cosine between their vectors: "
                      f"{cosines[key]:.7f}\n" for key in cosines)
            + (f"\n{skipped}\n" if skipped else ""))
    title = "Embedding throughput: LLM.embed vs sentence-transformers" + (" and llama.cpp" if server_bin else "")
    path = write_results(args.out or ("embed_llamacpp" if server_bin else "embed"), title, load_before, body,
                         {"num_texts": args.num_texts, "num_tokens": num_tokens, "size": args.size, "arch": arch,
                          "seconds": {names[k]: v for k, v in seconds.items()},
                          "tokens_per_s": {names[k]: v for k, v in rates.items()},
                          "ratio": {names[k]: v for k, v in ratios.items()},
                          "min_cosine": {names[k]: v for k, v in cosines.items()}})
    print(path.read_text())


def convert(script: str, folder: Path, tmp: Path, kind: str) -> Path:
    """The folder as a GGUF file of `kind` (f32, f16), by llama.cpp's converter."""
    out = tmp / f"bert-{kind}.gguf"
    subprocess.run([sys.executable, script, str(folder), "--outtype", kind, "--outfile", str(out)], check=True,
                   capture_output=True)
    return out


def _min_cosine(a, b) -> float:
    import numpy as np

    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench", help="make_model size (bench: hidden 768, 12 layers)")
    parser.add_argument("--arch", default="auto", choices=("auto", "bert", "bert_wordpiece"),
                        help="auto: bert_wordpiece with llama.cpp (its tokenizer reads WordPiece), else bert")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both (0: the library default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--llama-cpp-dir", default=None, help="folder of llama-server (default: $LLAMA_CPP_DIR)")
    parser.add_argument("--llama-cpp-convert", default=None, help="llama.cpp's convert_hf_to_gguf.py (or a wrapper)")
    parser.add_argument("--gguf-type", default="f32", choices=("f32", "f16"), help="the converted file's weights")
    parser.add_argument("--slots", type=int, default=8, help="llama-server's parallel sequences (-np)")
    parser.add_argument("--out", default=None, help="results file stem under bench/results "
                                                    "(default: embed, embed_llamacpp with llama.cpp)")
    return parser


if __name__ == "__main__":
    main()
