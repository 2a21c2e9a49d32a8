"""`python -m services diverge`: every should-be-invariant variant is identical on a tiny model,
a path that is not batch-invariant is caught, and the report files open in a browser."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from services.__main__ import main
from services.core.errors import InvalidArgument
from services.core.tokenizer import Tokenizer
from services.tools.diverge.cases import load_cases
from services.tools.diverge.compare import DIVERGED, IDENTICAL, SAME_TOKENS, Sample, compare
from services.tools.diverge.variants import IDENTICAL as EXPECT_IDENTICAL, local_variants, select

MAX_TOKENS = 8
PROMPTS = [
    {"id": "greedy-short", "prompt_token_ids": [5, 6, 7]},
    {"id": "greedy-long", "prompt_token_ids": list(range(10, 50))},  # 40 tokens: chunked, a prefix hit
    {"id": "text", "prompt": "hello world, this is a longer prompt for the tiny model"},
    {"id": "seeded", "prompt_token_ids": list(range(60, 90)), "temperature": 0.9, "top_p": 0.95, "seed": 11},
]


def write_prompts(folder: Path, entries=PROMPTS) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def diverge(model, prompts: Path, out: Path, *extra: str) -> tuple[int, dict]:
    code = main(["diverge", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                 "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--num-threads", "1", "--no-progress", *extra])
    report = out / "report.json"
    return code, json.loads(report.read_text()) if report.is_file() else {}


@pytest.fixture(scope="module")
def full_run(model_dir, tmp_path_factory):
    """Every local variant once on the tiny model (the module's one long run)."""
    folder = tmp_path_factory.mktemp("diverge")
    return diverge(model_dir("llama", "tiny"), write_prompts(folder), folder / "out") + (folder / "out",)


def variant(report: dict, name: str) -> dict:
    return next(v for v in report["variants"] if v["name"] == name)


@pytest.mark.slow
def test_every_variant_that_should_be_invariant_is_identical(full_run):
    code, report, _ = full_run
    invariant = [v for v in report["variants"] if v["expect"] == EXPECT_IDENTICAL]
    assert {v["name"] for v in invariant} >= {"batch-8", "batch-64", "position", "preempt-recompute", "preempt-swap",
                                             "chunk-8", "chunk-13", "prefix-hit", "block-8", "block-32", "tp-2",
                                             "pp-2", "spec-ngram", "spec-suffix"}
    for v in invariant:
        assert not v["error"], v
        assert {k: c["status"] for k, c in v["cells"].items()} == {p["id"]: IDENTICAL for p in PROMPTS}, v["name"]
    for name in ("preempt-recompute", "preempt-swap", "prefix-hit", "chunk-8"):
        assert variant(report, name)["exercised"], variant(report, name)["note"]  # it really preempted / hit / chunked
    for name in ("preempt-recompute", "preempt-swap"):  # every prompt, not only neighbours
        assert variant(report, name)["note"].startswith(f"{len(PROMPTS)}/{len(PROMPTS)} prompts preempted")
    assert variant(report, "batch-64")["cells"]["seeded"]["draws_same"] is True
    assert code == 0 and report["failures"] == []


@pytest.mark.slow
def test_the_may_differ_variants_are_shown_not_failed(full_run):
    code, report, _ = full_run
    bf16 = variant(report, "bfloat16")
    assert bf16["expect"] == "may differ" and not bf16["fails_on_difference"]
    assert all(c["status"] != IDENTICAL for c in bf16["cells"].values())  # other bits in bf16, shown
    tiers = [v for v in report["variants"] if v["group"] == "tier"]
    assert tiers and all(v["expect"] == "may differ" and not v["error"] for v in tiers)  # each tier the host runs
    hf = variant(report, "transformers")
    greedy = [p["id"] for p in PROMPTS if "temperature" not in p]
    assert [hf["cells"][k]["status"] for k in greedy] == [SAME_TOKENS] * len(greedy)  # same tokens as HF fp32
    assert hf["cells"]["seeded"]["status"] == "not run"  # greedy only
    assert code == 0


@pytest.mark.slow
def test_a_path_that_is_not_batch_invariant_is_caught(model_dir, tmp_path, monkeypatch):
    """No CPU path here diverges without the protection on its own: the project's GEMM is
    batch-invariant by construction. The test forces dense weights (what a host without that
    GEMM and without oneDNN runs: MKL's F.linear, whose rows get other bits with other row
    counts) and the reference kernels (the C decoder stack needs packed weights); then
    batch_invariant=False in a batch of 64 changes the logprobs, and the protection (padding)
    keeps batch-64 identical."""
    import services.worker.loader as loader
    from kernels.linear import prepack

    monkeypatch.setattr(loader, "prepack", lambda weight: prepack(weight, "dense"))
    prompts = write_prompts(tmp_path, PROMPTS[:2])
    code, report = diverge(model_dir("llama", "tiny"), prompts, tmp_path / "out", "--kernel-backend", "torch",
                           "--variants", "batch-64,no-invariance", "--fail-on", "invariant,no-invariance")
    cells = variant(report, "no-invariance")["cells"]
    assert {c["status"] for c in cells.values()} <= {SAME_TOKENS, DIVERGED}
    assert all(c["max_logprob_delta"] > 0 for c in cells.values())
    assert {c["status"] for c in variant(report, "batch-64")["cells"].values()} == {IDENTICAL}
    assert code == 1 and {v for v, _ in report["failures"]} == {"no-invariance"}


@pytest.mark.slow
def test_the_report_files_are_written_and_the_html_loads_in_chromium(full_run, tmp_path):
    _, report, out = full_run
    page = (out / "report.html").read_text()
    assert "<script src" not in page and "<link" not in page and "http://" not in page and "https://" not in page
    assert all(f'href="#{p["id"]}"' in page for p in PROMPTS)
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the HTML was not opened in a browser")
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", (out / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'data-rendered="yes"' in result.stdout  # the page's script ran to the end
    cells = len(PROMPTS) * len(report["variants"])
    assert f"{cells} cells" in result.stdout
    assert "Uncaught" not in result.stderr and "CONSOLE" not in result.stderr, result.stderr[-2000:]


def test_compare_finds_the_first_divergence_and_the_near_tie():
    ref = Sample(token_ids=[1, 2, 3, 4], logprobs=[-0.1, -0.2, -0.3, -0.4], margins=[1.0, 2.0, 0.01, 1.0], seed=5)
    same = compare(
        [ref],
        [Sample(token_ids=[1, 2, 3, 4], logprobs=[-0.1, -0.2, -0.3, -0.4], margins=[1.0, 2.0, 0.01, 1.0], seed=5)],
        sampled=True, near_tie=0.05)
    assert same.status == IDENTICAL and same.draws_same is True
    drift = compare([ref], [Sample(token_ids=[1, 2, 3, 4], logprobs=[-0.1, -0.25, -0.3, -0.4], margins=[1.0] * 4)],
                    False, 0.05)
    assert drift.status == SAME_TOKENS and drift.max_logprob_delta == pytest.approx(0.05)
    flip = compare(
        [ref],
        [Sample(token_ids=[1, 2, 9, 9], logprobs=[-0.1, -0.201, -0.31, -0.5], margins=[1.0, 2.0, 0.02, 1.0], seed=6)],
        True, 0.05)
    assert (flip.status, flip.first_divergence, flip.margin, flip.near_tie, flip.draws_same) == \
        (DIVERGED, 2, 0.01, True, False)
    assert flip.max_logprob_delta == pytest.approx(0.001)  # before the divergence only
    stopped = compare([ref], [Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], margins=[1.0, 2.0])], False, 0.05)
    assert (stopped.status, stopped.first_divergence) == (DIVERGED, 2)  # one run stopped, the other went on


def test_bad_prompt_files_name_the_line_and_field(model_dir, tmp_path):
    tokenizer = Tokenizer(model_dir("llama", "tiny"))
    for line, field in [("{not json", "prompts line 2"), ('{"prompt": "a", "messages": []}', "prompts line 2"),
                        ('{"prompt": "a", "temprature": 1}', "prompts line 2"),
                        ('{"prompt": "a", "top_p": 3}', "prompts line 2")]:
        path = tmp_path / "p.jsonl"
        path.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(InvalidArgument) as err:
            load_cases(path, tokenizer, {})
        assert err.value.field == field
    path.write_text('{"prompt": "x", "temperature": 0.5}\n')
    case = load_cases(path, tokenizer, {"max_tokens": 3})[0]
    assert (case.params.temperature, case.params.max_tokens, case.params.logprobs) == (0.5, 3, 2)


def test_unknown_variant_names_are_refused_before_anything_runs(model_dir, tmp_path, capsys):
    code = main(["diverge", "--model", str(model_dir("llama", "tiny")), "--prompts", str(write_prompts(tmp_path)),
                 "--variants", "batch-9", "--out", str(tmp_path / "out")])
    assert code == 2 and "variants: unknown variants or groups ['batch-9']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    variants = local_variants(16, "float32", 1, ["avx2"], "avx512", "cpu")
    assert [v.name for v in select(variants, "preemption,block-8", "variants")] == \
        ["preempt-recompute", "preempt-swap", "block-8"]
    assert {v.name for v in select(variants, "tier", "variants")} == {"tier-avx2", "kernels-torch"}
    assert all(v.expect == EXPECT_IDENTICAL for v in select(variants, "invariant", "fail_on"))


@pytest.mark.slow
def test_against_a_running_cluster_and_a_worker_killed_mid_request(model_dir, tmp_path):
    """The three services on loopback (one worker); diverge adds a worker of its own, which the
    scheduler fills first, and kills it mid-request: the cluster's worker recomputes the same bits."""
    from services.launch.deployment import free_ports
    from tests.e2e.test_launcher import REAL_SERVICES, Up, up_args

    if not REAL_SERVICES:
        pytest.skip("services not there")
    model = model_dir("llama", "tiny")
    ports = free_ports(3)
    up = Up(up_args(model, ports, workers=1) + ["--dtype", "float32", "--num-threads", "1", "--num-gpu-blocks", "64",
                                                 "--startup-timeout", "240"])
    try:
        up.wait_ready(timeout=300)
        entries = [{**p, "max_tokens": 24} for p in PROMPTS]  # long enough to be killed mid-request
        code, report = diverge(model, write_prompts(tmp_path, entries), tmp_path / "out", "--variants", "cluster",
                               "--against", f"127.0.0.1:{ports[0]}", "--scheduler", f"127.0.0.1:{ports[2]}")
    finally:
        up.stop()
    for name in ("cluster", "worker-killed"):
        v = variant(report, name)
        assert not v["error"], v["error"]
        assert {k: c["status"] for k, c in v["cells"].items()} == {p["id"]: IDENTICAL for p in PROMPTS}, (name, v)
    assert variant(report, "worker-killed")["exercised"], variant(report, "worker-killed")["note"]
    assert code == 0


@pytest.mark.slow
def test_transformers_reference_reads_a_gguf_file(tmp_path, model_dir):
    """`diverge --model FILE.gguf`: the transformers variant loads the file (transformers dequantizes it) and
    gives the folder's greedy tokens."""
    from services.tools.diverge.transformers_ref import TransformersReference
    from tests.gguf_files import write_gguf

    folder = model_dir("qwen2", "tiny")
    path = write_gguf(folder, tmp_path / "m.gguf", "f32")
    want = TransformersReference(folder).greedy([5, 6, 7, 8], 10).token_ids
    assert TransformersReference(path).greedy([5, 6, 7, 8], 10).token_ids == want


def test_the_baseline_engine_flags_are_the_engines_own_with_their_defaults(monkeypatch):
    """diverge declares no engine flag of its own: each is the engine's setting (its help, its default)."""
    import argparse
    import dataclasses

    from services.cli import env_name
    from services.core.config import SchedulerConfig, WorkerConfig
    from services.tools.diverge.cli import ENGINE_FIELDS, add_diverge_parser

    for name in ENGINE_FIELDS:
        monkeypatch.delenv(env_name(name), raising=False)
    parser = argparse.ArgumentParser()
    add_diverge_parser(parser.add_subparsers())
    args = parser.parse_args(["diverge", "--prompts", "p.jsonl"])
    defaults = {f.name: f.default for cls in (WorkerConfig, SchedulerConfig) for f in dataclasses.fields(cls)}
    assert {name: getattr(args, name) for name in ENGINE_FIELDS} == {name: defaults[name] for name in ENGINE_FIELDS}
    monkeypatch.setenv("PAGEDSERVE_DTYPE", "bfloat16")  # the engine's way in from the environment, too
    parser = argparse.ArgumentParser()
    add_diverge_parser(parser.add_subparsers())
    assert parser.parse_args(["diverge", "--prompts", "p.jsonl"]).dtype == "bfloat16"
