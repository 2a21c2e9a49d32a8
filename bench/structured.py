"""Structured outputs: what a JSON-schema constraint costs in throughput, and grammar compile times.

    python bench/structured.py                       # 16 ShareGPT requests at batch 16, 3 rounds
    python bench/structured.py --num-requests 16 --rounds 3 --dtype auto

The in-process engine (the same worker code as the services) runs the same ShareGPT requests
(greedy, ignore_eos, each exactly its output length) unconstrained and constrained, one pass of
each in turn (the host is shared and drifts), at batch size --num-requests (max_num_seqs). The
constrained pass gives every request a JSON schema with nested objects, enums, integer ranges and
bounded strings, in an array with minItems large enough that no output completes it before its
length: every token is sampled under a mask. Throughput is output tokens/s; the cost is
1 - constrained/unconstrained, the median over rounds of each round's own ratio. Also timed: the
share of the constrained pass the step spends waiting for and applying masks (Grammars.apply;
the masks are built on a side thread during the forward pass, so only what is not hidden counts), and the
compile time (frontend GrammarCache, cold) of a few schemas on the served tokenizer.
Writes bench/results/structured.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common import loadavg, markdown_table, write_results  # noqa: E402
from grammar_choice import NESTED  # noqa: E402
from workload import add_workload_flags, describe, load_workload, model_folder  # noqa: E402

ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "name": {"type": "string", "maxLength": 24},
    "status": {"enum": ["open", "closed", "pending"]},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["id", "name", "status", "score", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}
TOOL = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": f"tool_{i}"}, "arguments": ITEM},
     "required": ["name", "arguments"]} for i in range(8)]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.set_defaults(num_requests=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_before = loadavg()
    requests = load_workload(args)
    folder = model_folder(args.model)

    from pagedserve import LLM, SamplingParams
    from services.core.structured import Constraint, GrammarCache, make_tokenizer
    from services.worker import grammar

    llm = LLM(str(folder), dtype=args.dtype, max_num_seqs=len(requests), seed=0)
    mask_s = [0.0]
    original = grammar.Grammars.apply  # the step's wait for its masks (built beside the forward) and their use

    def timed_apply(self, logits, masks):
        started = time.perf_counter()
        original(self, logits, masks)
        mask_s[0] += time.perf_counter() - started

    grammar.Grammars.apply = timed_apply
    constraint = {"json": SCHEMA}

    def one_pass(constrained: bool) -> tuple[int, float, float]:
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True,
                                 structured_outputs=constraint if constrained else None) for r in requests]
        mask_s[0] = 0.0
        started = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(r.output_len for r in requests)
        if constrained:  # every output is a prefix the schema allows (checked cheaply: it starts an array)
            assert all(o.outputs[0].text.startswith("[") for o in outs)
        return tokens, elapsed, mask_s[0]

    one_pass(False), one_pass(True)  # warm-up (kernels, grammar cache)
    rounds = []
    for _ in range(args.rounds):
        free_tokens, free_s, _ = one_pass(False)
        tokens, seconds, masking = one_pass(True)
        rounds.append({"unconstrained_tok_s": free_tokens / free_s, "constrained_tok_s": tokens / seconds,
                       "ratio": (tokens / seconds) / (free_tokens / free_s), "mask_share": masking / seconds,
                       "mask_ms_per_step_token": 1e3 * masking / tokens})

    tokenizer = make_tokenizer((folder / "tokenizer.json").read_text(), llm.engine.workers["worker-0"].info.vocab_size,
                               llm.engine.workers["worker-0"].info.eos_token_ids)
    compiles = {}
    for name, c in [("throughput schema (array of objects)", Constraint.json_schema(SCHEMA)),
                    ("nested schema (bench/grammar_choice.py)", Constraint.json_schema(NESTED)),
                    ("tool_choice required, 8 tools", Constraint.json_schema(TOOL)),
                    ("regex (email)", Constraint("regex", r"[a-z]{1,16}@[a-z]{1,16}\.(com|org|net)")),
                    ("json_object", Constraint("json_object"))]:
        times = []
        for _ in range(5):
            cache = GrammarCache(tokenizer)
            started = time.perf_counter()
            cache.matcher(c)
            times.append(1e3 * (time.perf_counter() - started))
        compiles[name] = statistics.median(times)

    ratio = statistics.median(r["ratio"] for r in rounds)
    rows = [[i + 1, f"{r['unconstrained_tok_s']:.1f}", f"{r['constrained_tok_s']:.1f}", f"{r['ratio']:.3f}",
             f"{100 * r['mask_share']:.1f}%"] for i, r in enumerate(rounds)]
    body = "\n".join([
        f"Workload: {describe(args)}; batch {len(requests)} (max_num_seqs), dtype {args.dtype}, "
        "greedy, ignore_eos.", "",
        markdown_table(["round", "unconstrained tok/s", "JSON schema tok/s", "ratio", "time in masks"], rows), "",
        f"**Median ratio {ratio:.3f}: a JSON-schema constraint costs {100 * (1 - ratio):.1f}% of throughput at "
        f"batch {len(requests)}** (target: under 10%).", "",
        markdown_table(["constraint", "compile ms (cold cache, median of 5)"],
                       [[k, f"{v:.2f}"] for k, v in compiles.items()]), ""])
    md = write_results("structured", "Structured outputs: throughput cost and compile times", load_before, body,
                       {"rounds": rounds, "median_ratio": ratio, "compile_ms": compiles,
                        "num_requests": len(requests)})
    print(md.read_text())


if __name__ == "__main__":
    main()
