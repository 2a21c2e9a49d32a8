"""lm-evaluation-harness's throughput against the server (issue 45): its `local-completions` model
on the tiny local tasks of tests/evaluation/tasks (a multiple-choice task scored by loglikelihood,
a generate_until task), their documents repeated --repeat times, timed per task, and the scores and
answers checked equal across the batch sizes (pagedserve's batch invariance: the same bits in any
batch).

    python bench/lm_eval_throughput.py --model FOLDER [--repeat 20] [--batch-sizes 1,16] [--concurrency 4]
    python bench/lm_eval_throughput.py --model FOLDER --url http://127.0.0.1:8000   # a server already up
    python bench/lm_eval_throughput.py --model FOLDER --peer-url http://127.0.0.1:8001 --peer-model NAME

Without --url it starts `python -m services up` on free loopback ports (bench/services_run.py). A
peer (vLLM's OpenAI server on the same model folder, e.g. vLLM's CPU build from bench/install_vllm.sh,
started by hand) is run on the same tasks and settings for comparison. Writes
bench/results/lm_eval_throughput.{md,json}. On a loaded host the figures are noise: run it on a quiet one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, loadavg, markdown_table, write_results  # noqa: E402

TASKS = ("pagedserve_tiny_choice", "pagedserve_tiny_until")
TASK_DIR = REPO / "tests" / "evaluation" / "tasks"


def repeated_tasks(repeat: int) -> Path:
    """The tiny tasks over their documents repeated `repeat` times, in a folder of their own."""
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-lm-eval-"))
    docs = (TASK_DIR / "tiny.jsonl").read_text().splitlines()
    (folder / "tiny.jsonl").write_text("\n".join(docs * repeat) + "\n")
    for task in ("tiny_choice", "tiny_until"):
        text = (TASK_DIR / f"{task}.yaml").read_text()
        (folder / f"{task}.yaml").write_text(text.replace("tests/evaluation/tasks/tiny.jsonl", str(folder / "tiny.jsonl")))
    return folder


def run_task(url: str, model: str, tokenizer: str, task: str, folder: Path, batch_size: int, concurrency: int):
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="local-completions", batch_size=batch_size, log_samples=True,
        model_args={"model": model, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": tokenizer, "num_concurrent": concurrency, "max_retries": 1},
        tasks=[task], task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    seconds = time.perf_counter() - start
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    num_requests = sum(len(s["resps"]) for s in samples)
    return {"seconds": seconds, "requests": num_requests, "requests_per_s": num_requests / seconds,
            "score": results["results"][task], "resps": [s["resps"] for s in samples]}


def measure(server: str, url: str, model: str, tokenizer: str, folder: Path, args) -> list[dict]:
    rows = []
    for batch_size in args.batch_sizes:
        for task in TASKS:
            result = run_task(url, model, tokenizer, task, folder, batch_size, args.concurrency)
            rows.append({"server": server, "task": task, "batch_size": batch_size, **result})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "resps"}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model folder (its tokenizer is the harness's too)")
    parser.add_argument("--url", help="a pagedserve HTTP address already serving --model (else one is started)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=20, help="each task's 6 documents, this many times")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--concurrency", type=int, default=4, help="the harness's num_concurrent")
    parser.add_argument("--peer-url", help="another OpenAI-compatible server on the same model (e.g. vLLM's)")
    parser.add_argument("--peer-model", help="the model id the peer serves")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before, folder = loadavg(), repeated_tasks(args.repeat)
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    if args.url:
        rows = measure("pagedserve", args.url.rstrip("/"), model, model, folder, args)
    else:
        from services_run import launched
        with launched(model, args.dtype, backend="http") as address:
            rows = measure("pagedserve", f"http://{address}", model, model, folder, args)
    if args.peer_url:
        rows += measure("peer", args.peer_url.rstrip("/"), args.peer_model or model, model, folder, args)
    for server in {r["server"] for r in rows}:
        for task in TASKS:
            runs = [r for r in rows if r["server"] == server and r["task"] == task]
            for r in runs:
                r["same_as_first_batch_size"] = r["resps"] == runs[0]["resps"] and r["score"] == runs[0]["score"]
    table = markdown_table(["server", "task", "batch size", "requests", "seconds", "requests/s", "same as batch 1"],
                           [[r["server"], r["task"], r["batch_size"], r["requests"], r["seconds"], r["requests_per_s"],
                             r["same_as_first_batch_size"]] for r in rows])
    body = (f"lm-evaluation-harness {__import__('lm_eval').__version__} `local-completions`, each task's 6 documents "
            f"x {args.repeat}, num_concurrent {args.concurrency}; a loglikelihood request is one choice scored.\n\n"
            + table)
    data = {"rows": [{k: v for k, v in r.items() if k != "resps"} for r in rows]}
    print(write_results("lm_eval_throughput", "lm-evaluation-harness throughput", load_before, body, data))


if __name__ == "__main__":
    main()
