"""Run the baseline and every chosen variant over the cases, and compare each with its reference."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from services.core.errors import InvalidArgument
from services.core.model_path import resolve_model_path
from services.core.tokenizer import Tokenizer
from services.tools.diverge.cases import Case, load_cases
from services.tools.diverge.compare import NOT_RUN, Cell, compare
from services.tools.diverge.engine_runs import EngineRuns, Run
from services.tools.diverge.report import Report, VariantResult
from services.tools.diverge.variants import (CLUSTER, CLUSTER_KILL, TRANSFORMERS, Variant, cluster_variants,
                                             local_variants, select)


@dataclass(kw_only=True)
class Options:
    model_path: Path
    engine_args: dict  # the baseline's (prefix caching off: a hit is a variant of its own)
    variants: str = "all"  # names or groups (variants.select)
    fail_on: str = "invariant"
    near_tie: float = 0.05
    against: str | None = None  # a running cluster's frontend, HOST:PORT
    scheduler: str | None = None  # its scheduler, HOST:PORT: enables worker-killed
    progress: bool = True


def host_tiers(cpu_isa: str, kernels: str) -> tuple[list[str], str | None]:
    """The kernel tiers this host runs, and the one the baseline runs (cpu_isa, or the one auto
    picks); none where the baseline does not run the compiled CPU kernels."""
    from kernels import build, cpu_kernels

    if kernels != "cpu":
        return [], None
    return list(build.host_tiers()), cpu_kernels.select_isa(cpu_isa)


@dataclass(kw_only=True)
class Plan:
    cases: list[Case]
    variants: list[Variant]  # to run, in order
    fail_on: list[Variant]
    options: Options
    runs: EngineRuns
    settings: dict


def prepare(args) -> Plan:
    """Everything checked before the first engine starts: the model, the prompts, the variant names.
    Raises InvalidArgument (or ValueError) naming what is wrong."""
    import torch

    from kernels.ops import get_ops
    from services.tools.diverge.cli import sampling_defaults
    from services.worker.loader import resolve_dtype
    from services.worker.model_config import ModelArchConfig
    from services.worker.worker import pick_device

    model_path = resolve_model_path(args.model)
    cases = load_cases(args.prompts, Tokenizer(model_path), sampling_defaults(args))
    arch = ModelArchConfig.from_model(model_path)
    device = pick_device("auto")
    dtype = str(resolve_dtype(args.dtype, arch, device)).removeprefix("torch.")
    num_threads = args.num_threads or torch.get_num_threads()
    engine_args = dict(dtype=dtype, block_size=args.block_size, num_threads=num_threads,
                       kernel_backend=args.kernel_backend, cpu_isa=args.cpu_isa, seed=args.engine_seed,
                       enable_prefix_caching=False)
    if args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    kernels = get_ops(args.kernel_backend, device.type, args.cpu_isa).name
    tiers, tier = host_tiers(args.cpu_isa, kernels)
    variants = local_variants(args.block_size, dtype, num_threads, tiers, tier, kernels)
    if args.against:
        variants += cluster_variants(with_kill=bool(args.scheduler))
    elif args.scheduler:
        raise InvalidArgument("scheduler", "needs --against (the same cluster's frontend)")
    options = Options(model_path=model_path, engine_args=engine_args, variants=args.variants, fail_on=args.fail_on,
                      near_tie=args.near_tie, against=args.against, scheduler=args.scheduler, progress=args.progress)
    settings = {**engine_args, "kernels": kernels, "tier": tier, "device": device.type,
                "num_prompts": len(cases)}
    return Plan(cases=cases, variants=select(variants, args.variants, "variants"),
                fail_on=select(variants, args.fail_on, "fail_on"), options=options,
                runs=EngineRuns(str(model_path), engine_args, arch.vocab_size, cases, args.engine_seed),
                settings=settings)


def run_all(plan: Plan) -> Report:
    baseline = plan.runs.baseline(plan.cases)
    return diverge(plan.cases, plan.variants, plan.fail_on, plan.options, plan.runs, baseline, plan.settings)


def run_variant(runs: EngineRuns, variant: Variant, cases: list[Case], options: Options) -> Run:
    if variant.where == TRANSFORMERS:
        from services.tools.diverge.transformers_ref import TransformersReference

        ref = TransformersReference(options.model_path)
        return Run(samples={c.id: [ref.greedy(list(c.prompt_token_ids), c.params.max_tokens, c.params.ignore_eos)]
                    for c in cases if c.params.greedy})
    if variant.where in (CLUSTER, CLUSTER_KILL):
        from services.tools.diverge.cluster import run_on_cluster

        return run_on_cluster(variant, cases, options.against, options.scheduler, options.model_path,
                              runs.base_args)
    return runs.run(variant, cases)


def result_of(variant: Variant, run: Run, baseline: Run, cases: list[Case], near_tie: float) -> VariantResult:
    result = VariantResult(variant=variant, note=run.note, exercised=run.exercised)
    reference = run.reference or baseline.samples
    for case in cases:
        if case.id not in run.samples:
            reason = "greedy only" if variant.greedy_only and not case.params.greedy else "no output"
            result.cells[case.id] = Cell(status=NOT_RUN, reason=reason)
            continue
        result.cells[case.id] = compare(reference[case.id], run.samples[case.id], not case.params.greedy, near_tie)
    return result


def diverge(cases: list[Case], variants: list[Variant], fail_on: list[Variant], options: Options,
            runs: EngineRuns, baseline: Run, settings: dict) -> Report:
    report = Report(model=str(options.model_path), settings=settings, cases=cases, baseline=baseline.samples,
                    fail_on=tuple(v.name for v in fail_on), near_tie=options.near_tie)
    with tqdm(variants, desc="diverge", unit="variant", disable=not options.progress) as bar:
        for variant in bar:
            bar.set_postfix_str(variant.name)
            start = time.monotonic()
            try:
                result = result_of(variant, run_variant(runs, variant, cases, options), baseline, cases,
                                   options.near_tie)
            except Exception as exc:  # noqa: BLE001 - one variant that cannot run must not hide the others
                result = VariantResult(variant=variant,
                                       cells={c.id: Cell(status=NOT_RUN, reason="error") for c in cases},
                                       error=f"{type(exc).__name__}: {exc}")
            result.seconds = time.monotonic() - start
            report.results.append(result)
    return report
