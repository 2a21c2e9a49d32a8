"""`python -m services diverge`: the flags, the run, the three outputs and the exit code."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.cli import add_config_flags
from services.core.config import IN_PROCESS_DEFAULTS, SchedulerConfig, WorkerConfig
from services.core.errors import InvalidArgument

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE = 0, 1, 2
# the baseline engine's settings: the engine's own flags, declared once by their dataclasses
ENGINE_FIELDS = ("dtype", "block_size", "num_threads", "kernel_backend", "cpu_isa", "max_model_len")
SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                  "seed": int, "max_tokens": int, "n": int}


def add_diverge_parser(commands) -> None:
    p = commands.add_parser(
        "diverge", help="why did my output change? each cause of drift, one at a time, against a batch-1 baseline",
        description="Run every prompt through variants that each change one variable from a batch-1 baseline "
                    "(batch size, position, preemption, chunked prefill, prefix cache, block size, threads, dtype, "
                    "kernel tier, batch_invariant=False, Hugging Face transformers, and with --against a running "
                    "cluster) and report, per prompt and variant, whether the output is identical, where it first "
                    "diverges, and whether that was a near-tie. Exit code 1 when a variant counted by --fail-on "
                    "is not identical.")
    p.add_argument("--model", default="default", help='a model folder, a hub id, or "default" (SmolLM2-135M-Instruct)')
    p.add_argument("--prompts", required=True, type=Path,
                   help='JSONL: {"prompt": ...} | {"messages": [...]} | {"prompt_token_ids": [...]}, optional "id" '
                        "and sampling fields that override the flags")
    sampling = p.add_argument_group("sampling (defaults for every prompt)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    for name, kind in SAMPLING_FLAGS.items():
        if name != "temperature":
            sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    sampling.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False)
    engine = p.add_argument_group("the baseline's engine")
    add_config_flags(engine, WorkerConfig, SchedulerConfig, only=ENGINE_FIELDS)
    engine.add_argument("--engine-seed", type=int, default=IN_PROCESS_DEFAULTS["seed"],  # --seed is sampling's
                        help=f"draws the seeds of prompts without one (default: {IN_PROCESS_DEFAULTS['seed']}, LLM's)")
    what = p.add_argument_group("what to run and report")
    what.add_argument("--variants", default="all", help="comma-separated variant names or groups (default all)")
    what.add_argument("--fail-on", default="invariant",
                      help='variants whose difference fails the command: names, groups, "invariant" (default: '
                           'those that should be identical), "all" or "none"')
    what.add_argument("--near-tie", type=float, default=0.05,
                      help="a top-2 logprob margin below this at a divergence marks a near-tie")
    what.add_argument("--against", default=None, metavar="HOST:PORT", help="a running cluster's gRPC frontend")
    what.add_argument("--scheduler", default=None, metavar="HOST:PORT",
                      help="that cluster's scheduler: adds worker-killed (a worker of ours, killed mid-request)")
    what.add_argument("--out", type=Path, default=Path("diverge-report"), help="folder for report.json and report.html")
    what.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    what.add_argument("--log-level", default="warning", help="the engines' logs (JSON lines on stderr)")
    p.set_defaults(run=run_diverge_command)


def sampling_defaults(args: argparse.Namespace) -> dict:
    out = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    out["ignore_eos"] = args.ignore_eos
    return out


def run_diverge_command(args: argparse.Namespace) -> int:
    from services.launch.logs import configure_logging
    from services.tools.diverge.render import html_page, text_table
    from services.tools.diverge.run import prepare, run_all

    configure_logging("diverge", args.log_level)
    try:
        plan = prepare(args)
    except (InvalidArgument, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = run_all(plan)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report.to_json(), indent=1))
    (args.out / "report.html").write_text(html_page(report))
    print(text_table(report))
    print(f"wrote {args.out / 'report.json'} and {args.out / 'report.html'}")
    return EXIT_DIVERGED if report.failures() else EXIT_OK
