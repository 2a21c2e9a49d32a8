"""Embedding throughput (tokens/s): pagedserve's LLM.embed against sentence-transformers' own batched
encode, on the same random-weight BERT (make_model --arch bert, with its sentence-transformers layout)
and the same texts, in fp32, interleaved round by round so a burst of load hits both alike.

The claim it measures (issue 43): serving embeddings through pagedserve's engine costs no more than
embedding with the library users embed with. Each contender embeds the whole set once per round; the
table gives the median tokens/s over the rounds (prompt tokens as the model's tokenizer counts them,
special tokens included) and the cosine of the two sets of vectors (parity, not speed).

    .venv/bin/python bench/embed.py [--size bench] [--num-texts 256] [--rounds 3] [--batch-size 32] [--threads 0]

A figure only means something on a quiet host (the load average is in the results file's header).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, markdown_table, write_results  # noqa: E402
from services.tools.make_model import make_model  # noqa: E402

WORDS = ("the scheduler places each request on a worker holding its longest cached prefix while blocks "
         "are freed when a request finishes and the frontend checks every parameter before it runs").split()


def texts(num: int, seed: int = 0) -> list[str]:
    """Sentences of 8 to 120 words, a retrieval corpus's spread of lengths."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench", help="make_model size (bench: hidden 768, 12 layers)")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both (0: the library default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--out", default="embed", help="results file stem under bench/results")
    args = parser.parse_args()

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = loadavg()
    corpus = texts(args.num_texts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "bert", arch="bert", size=args.size, seed=0)
        llm = LLM(str(folder), dtype="float32", num_threads=args.threads,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256)
        st = SentenceTransformer(str(folder), device="cpu")
        num_tokens = sum(len(llm.tokenizer.encode_pooling(t)) for t in corpus)
        seconds = {"pagedserve LLM.embed": [], "sentence-transformers encode": []}
        vectors = {}
        for _ in range(args.rounds):
            start = time.perf_counter()
            vectors["ours"] = [o.outputs.embedding for o in llm.embed(corpus, use_tqdm=False)]
            seconds["pagedserve LLM.embed"].append(time.perf_counter() - start)
            start = time.perf_counter()
            vectors["st"] = st.encode(corpus, batch_size=args.batch_size, convert_to_numpy=True)
            seconds["sentence-transformers encode"].append(time.perf_counter() - start)
    ours, ref = np.asarray(vectors["ours"]), vectors["st"]
    cosine = float(((ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)).min())
    rates = {name: num_tokens / statistics.median(s) for name, s in seconds.items()}
    rows = [[name, f"{rates[name]:.0f}", f"{statistics.median(s):.2f}", f"{min(s):.2f}"]
            for name, s in seconds.items()]
    ratio = rates["pagedserve LLM.embed"] / rates["sentence-transformers encode"]
    body = (f"make_model --arch bert --size {args.size}, fp32; {args.num_texts} texts, {num_tokens} tokens; "
            f"{args.rounds} rounds, interleaved; sentence-transformers batch size {args.batch_size}; "
            f"torch threads {args.threads or 'default'}\n\n"
            + markdown_table(["contender", "tokens/s (median)", "s per round (median)", "s (fastest)"], rows)
            + f"\npagedserve / sentence-transformers: {ratio:.2f}x; lowest cosine between their vectors: "
              f"{cosine:.7f}\n")
    path = write_results(args.out, "Embedding throughput: LLM.embed vs sentence-transformers", load_before, body,
                         {"num_texts": args.num_texts, "num_tokens": num_tokens, "size": args.size,
                          "seconds": seconds, "tokens_per_s": rates, "ratio": ratio, "min_cosine": cosine})
    print(path.read_text())


if __name__ == "__main__":
    main()
