"""lm-evaluation-harness as a real client of `pagedserve up` (issue 45; docs/guide/scoring.md): its
`local-completions` model, on two tiny local tasks (tests/evaluation/tasks: a multiple-choice task,
scored by loglikelihood through /v1/completions with echo and logprobs, and a generate_until task),
twice, with different batch sizes (prompts per HTTP request) and concurrency. Every loglikelihood,
every generated answer and every score must be identical: bit-exact scoring whatever the batch.

The harness runs in this process (`lm_eval.simple_evaluate`, what the `lm_eval` command calls) with
only these tasks indexed: the command indexes its thousands of built-in tasks first, a minute and a
half on this host. The data are a local JSONL file (the `json` dataset builder; nothing is fetched)."""
from __future__ import annotations

import pytest

from services.launch.deployment import free_ports
from tests.e2e.test_launcher import REAL_SERVICES, ROOT, Up, up_args

lm_eval = pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]

TASKS = ["pagedserve_tiny_choice", "pagedserve_tiny_until"]
TASK_DIR = ROOT / "tests" / "evaluation" / "tasks"


@pytest.fixture(scope="module")
def server(tiny_llama):
    ports = free_ports(3)
    up = Up(up_args(tiny_llama, ports, workers=1) + ["--dtype", "float32", "--num-gpu-blocks", "128",
                                                     "--startup-timeout", "240"])
    try:
        up.wait_ready(timeout=300)
        yield f"http://127.0.0.1:{ports[1]}", str(tiny_llama)
        up.stop()
    finally:
        up.kill_all()


def evaluate(url: str, model: str, batch_size: int, num_concurrent: int) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions", batch_size=batch_size, log_samples=True,
        model_args={"model": model, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": model, "num_concurrent": num_concurrent, "max_retries": 1},
        tasks=TASKS, task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False))


def outcome(results: dict) -> dict:
    """Each task's score and each document's responses (loglikelihoods and greedy flags, or texts)."""
    return {task: (results["results"][task], [(s["doc_id"], s["resps"]) for s in
                                              sorted(results["samples"][task], key=lambda s: s["doc_id"])])
            for task in TASKS}


def test_lm_eval_scores_the_same_whatever_the_batch(server, monkeypatch):
    monkeypatch.chdir(ROOT)  # the tasks name their data file from the repository's root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url, model = server
    one = outcome(evaluate(url, model, batch_size=1, num_concurrent=1))
    batched = outcome(evaluate(url, model, batch_size=6, num_concurrent=2))
    assert batched == one
    _, samples = one["pagedserve_tiny_choice"]
    assert len(samples) == 6 and all(len(resps) == 3 for _, resps in samples)  # a loglikelihood per choice
    loglikelihoods = [float(r[0][0]) for _, resps in samples for r in resps]
    assert all(ll < 0 for ll in loglikelihoods) and len(set(loglikelihoods)) == len(loglikelihoods)
    _, answers = one["pagedserve_tiny_until"]
    assert len(answers) == 6 and any(resps[0][0] for _, resps in answers)  # texts were generated
