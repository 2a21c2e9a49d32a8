"""How long services/tools/make_model.py takes to write a random model of each preset size.

The claim (once a timed unit test, which CONTRIBUTING.md rules out): a `small` model is made in
under 2 s, so tests and benchmarks can build theirs on the spot instead of downloading one.
Each size is made --repeats times, interleaved, each time from scratch (the tokenizer's cache
cleared, a fresh folder); the table gives the median and the fastest run.

    .venv/bin/python bench/make_model.py [--sizes tiny,small] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import loadavg, markdown_table, show_results  # noqa: E402
from services.tools import make_tokenizer  # noqa: E402
from services.tools.make_model import make_model, num_parameters  # noqa: E402

CLAIM_S = {"small": 2.0}  # the size whose time is claimed, and the bound


def time_once(size: str, folder: Path) -> float:
    make_tokenizer.tokenizer_json.cache_clear()  # from scratch, as a test session's first build
    start = time.perf_counter()
    make_model(folder, arch="llama", size=size, seed=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    load_before = loadavg()
    seconds: dict[str, list[float]] = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for size in sizes:  # interleaved: a burst of load hits every size alike
                seconds[size].append(time_once(size, Path(tmp) / f"{size}-{i}"))
    rows = [[size, num_parameters("llama", size), f"{statistics.median(s):.2f}", f"{min(s):.2f}",
             f"under {CLAIM_S[size]:.0f} s: {'yes' if statistics.median(s) < CLAIM_S[size] else 'NO'}"
             if size in CLAIM_S else ""] for size, s in seconds.items()]
    body = (f"make_model(arch='llama', size=..., seed=0), {args.repeats} runs per size, interleaved; "
            "the host is shared with other developers' jobs (load average above).\n\n"
            + markdown_table(["size", "parameters", "median s", "fastest s", "claim"], rows))
    show_results("make_model", "Making a random model (services/tools/make_model.py)", load_before, body,
                 {"repeats": args.repeats, "seconds": seconds, "claim_s": CLAIM_S})


if __name__ == "__main__":
    main()
