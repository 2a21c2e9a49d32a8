"""Speculative decoding on and off, interleaved in one run, on three workloads; acceptance reported.

Workloads (the served model's chat template, greedy, in process):
- copy: batch 1, code edits. Each prompt is one function or class of this repository's own sources
  (services/ and kernels/ .py files, 12-35 lines, chosen by --seed), with an instruction to return
  it with one identifier renamed (the identifier: the longest name that appears in it at least
  twice) and nothing else changed; the reply is begun for the model up to the code's first line
  (a 135M model otherwise explains the code instead). The answer copies most of the prompt.
- quoting: batch 1, ShareGPT V3 multi-turn conversations whose later gpt reply quotes an earlier
  turn (at least 30% of the reply's 8-grams occur earlier in the conversation); the prompt is the
  conversation up to the human turn before that reply. The model writes its own reply.
- sharegpt-16: the ordinary ShareGPT workload (first human turn, bench/workload.py) at batch 16.
- sweep: ordinary ShareGPT with drafting forced at every batch size (disable_by_batch_size=0), at
  batch 1, 2, 4 and 8 (16: the sharegpt-16 row): where it stops paying, which sets the default of disable_by_batch_size.

For each workload the two engines (one with --speculative-config, one without; both loaded once)
run the same requests alternately, --repeats times, off first then on then on first; the figure is
the median of the per-pass ratios of generated tokens per second. The tokens of both are compared
(greedy: they must be identical). Load average before and after is in the results file: the host
is shared with other developers' builds and tests, so absolute figures are noisy.

    python bench/spec.py                          # all three workloads and the sweep
    python bench/spec.py --workloads copy --repeats 3
"""
from __future__ import annotations

import argparse
import ast
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, loadavg, markdown_table, write_results  # noqa: E402
from bench.workload import model_folder, read_conversations, sharegpt_path, sharegpt_requests  # noqa: E402

QUOTE_NGRAM = 8
QUOTE_SHARE = 0.3


# ---- workloads -------------------------------------------------------------------------------
def code_units(min_lines: int = 12, max_lines: int = 35) -> list[str]:
    """Top-level functions and classes of the repository's Python sources, 12-35 lines."""
    units = []
    for path in sorted([*REPO.glob("services/**/*.py"), *REPO.glob("kernels/*.py")]):
        text = path.read_text()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                body = lines[node.lineno - 1:node.end_lineno]
                if min_lines <= len(body) <= max_lines:
                    units.append("\n".join(body))
    return units


def rename_target(code: str) -> str:
    """The longest identifier used at least twice (ties: first seen)."""
    names = re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", code)
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return max((n for n, c in counts.items() if c >= 2), key=len)


def copy_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    units = code_units()
    random.Random(seed).shuffle(units)
    prompts = []
    for code in units[:num]:
        name = rename_target(code)
        text = (f"Rename `{name}` to `{name}_new` in this Python code. Reply with the whole code, changed only "
                f"there, in one code block.\n\n```python\n{code}\n```")
        # the reply is begun for the model (a prefilled assistant turn, after the chat template's generation
        # prompt): the code block opened and its first line, renamed, written WITHOUT the newline after it.
        # A prompt ending in "\n" cuts the tokenizer's "\n" + indentation merge in two: the model then sees a
        # line break no code it was trained on has, closes the block and explains instead (0.99x in the run
        # of 2026-12-02 00:23); left to write the "\n    " itself it copies (bench/README.md).
        first_line = code.splitlines()[0].replace(name, f"{name}_new")
        opening = f"```python\n{first_line}"
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]) + opening,
                                        add_special_tokens=False))
    return prompts


def _ngrams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def quoting_prompts(tokenizer, num: int, seed: int, max_prompt_len: int, path: str | None) -> list[list[int]]:
    """Conversations whose later reply quotes an earlier turn; the prompt ends before that reply."""
    conversations = read_conversations(sharegpt_path(path))
    random.Random(seed).shuffle(conversations)
    prompts = []
    for conversation in conversations:
        turns = [t for t in conversation.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in turns]
        for i in range(2, len(messages)):
            if messages[i]["role"] != "assistant" or messages[i - 1]["role"] != "user":
                continue
            earlier = _ngrams(tokenizer.encode("\n".join(m["content"] for m in messages[:i]),
                                               add_special_tokens=False), QUOTE_NGRAM)
            reply = _ngrams(tokenizer.encode(messages[i]["content"], add_special_tokens=False), QUOTE_NGRAM)
            if len(reply) < 16 or len(reply & earlier) < QUOTE_SHARE * len(reply):
                continue
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages[:i]), add_special_tokens=False)
            if len(ids) <= max_prompt_len:
                prompts.append(ids)
                break
        if len(prompts) == num:
            return prompts
    raise SystemExit(f"only {len(prompts)} quoting conversations found, {num} asked")


# ---- runs ------------------------------------------------------------------------------------
def timed(llm, prompts, params) -> tuple[float, float, list[list[int]]]:
    """(seconds in all, seconds after the group's first token, the tokens): the second leaves out the
    prefill, the same with speculation on or off."""
    engine, first = llm.engine, []
    step = engine.step

    def timed_step():
        updates = step()
        if not first and any(u.token_ids for u in updates):
            first.append(time.perf_counter())
        return updates

    engine.step = timed_step
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        end = time.perf_counter()
    finally:
        engine.step = step
    return end - start, end - first[0], [o.outputs[0].token_ids for o in outs]


def compare(off, on, prompts, params, repeats: int, batch: int) -> dict:
    """Alternating passes; prompts run in groups of `batch` (each group one generate call)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    spec = on.scheduler.speculator
    before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens, spec.stats.num_drafts,
              list(spec.stats.accepted_per_pos))
    ratios, decode_ratios, times, identical = [], [], {"off": [], "on": []}, True
    for r in range(repeats):
        order = [("off", off), ("on", on)] if r % 2 == 0 else [("on", on), ("off", off)]
        tokens, seconds, decode_seconds = {}, {}, {}
        for name, llm in order:
            total, decode, got = 0.0, 0.0, []
            for group in groups:
                t, d, ids = timed(llm, group, params)
                total, decode, got = total + t, decode + d, got + ids
            tokens[name], seconds[name], decode_seconds[name] = got, total, decode
            times[name].append(total)
        identical &= tokens["off"] == tokens["on"]
        ratios.append(seconds["off"] / seconds["on"])
        decode_ratios.append(decode_seconds["off"] / decode_seconds["on"])
    num_tokens = sum(len(t) for t in tokens["off"])
    drafted = spec.stats.num_draft_tokens - before[0]
    accepted = spec.stats.num_accepted_tokens - before[1]
    drafts = spec.stats.num_drafts - before[2]
    # acceptance by position: of the verify passes, the share whose draft i was accepted
    per_pos = [(a - b) / drafts if drafts else 0.0 for a, b in zip(spec.stats.accepted_per_pos, before[3])]
    return {"speedup": statistics.median(ratios), "speedups": ratios, "identical": identical,
            "decode_speedup": statistics.median(decode_ratios), "decode_speedups": decode_ratios,
            "tok_s_off": num_tokens / statistics.median(times["off"]),
            "tok_s_on": num_tokens / statistics.median(times["on"]),
            "output_tokens": num_tokens, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0, "acceptance_per_pos": per_pos,
            "tokens_per_verify": (accepted + drafts) / drafts if drafts else 0.0,
            "accepted_per_token": accepted / (num_tokens * repeats)}


def verify_cost(llm, context: int, batches: tuple[int, ...], rows: tuple[int, ...], repeats: int) -> dict:
    """Seconds of one forward pass (and the logits of the rows a verify samples) for `batch` sequences
    of `context` tokens each running n rows at their end (n = 1: a decode step; n = k + 1: a verify
    of k drafts), over the model runner's own batch preparation; all shapes alternated `repeats` times.
    Returns {batch: {n: median seconds}}."""
    from services.core.sampling_params import SamplingParams
    from services.worker.model_runner import SeqState

    runner = llm.engine.workers["worker-0"].runner
    bs, per_seq = runner.block_size, -(-context // runner.block_size)

    def once(batch: int, n: int) -> float:
        scheduled = [(SeqState(seq_id=b, prompt_token_ids=[100 + i % 997 for i in range(context)], output_token_ids=[],
                               block_ids=list(range(b * per_seq, (b + 1) * per_seq)), num_computed_tokens=context - n,
                               params=SamplingParams(temperature=0, seed=0), sample_index=0), n)
                     for b in range(batch)]
        prepared = runner._prepare(scheduled)
        start = time.perf_counter()
        hidden = runner.model(*runner._tensors(prepared))
        runner.model.compute_logits(hidden)  # every row samples in a verify
        return time.perf_counter() - start

    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(repeats):
        for batch in batches:
            for n in rows:
                times.setdefault((batch, n), []).append(once(batch, n))
    return {batch: {n: statistics.median(times[(batch, n)]) for n in rows} for batch in batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cost,copy,quoting,sharegpt-16,sweep")
    parser.add_argument("--spec", default='{"method": "ngram"}',
                        help="the speculative_config (JSON); unset keys take the engine's defaults")
    parser.add_argument("--num-prompts", type=int, default=4, help="copy and quoting prompts (batch 1)")
    parser.add_argument("--max-tokens", type=int, default=128, help="copy and quoting")
    parser.add_argument("--batch-max-tokens", type=int, default=48, help="sharegpt-16 and the sweep")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--sharegpt-path", default=None)
    parser.add_argument("--max-prompt-len", type=int, default=768)
    parser.add_argument("--stem", default="spec")
    parser.add_argument("--cost-context", type=int, default=384, help="cost: tokens of each sequence's context")
    parser.add_argument("--cost-repeats", type=int, default=9, help="cost: passes over every shape")
    parser.add_argument("--cost-batches", default="1,4,8,16", help="cost: sequences per pass")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="the engines' threads (default: the engine's); 1 on a host loaded past its cores, where "
                             "two threads' OpenMP barriers wait on each other's preemption")
    parser.add_argument("--activation-quant", default=None,
                        help="the engines' activation_quant (auto, none, int8; default: the engine's own)")
    args = parser.parse_args()

    from pagedserve import LLM
    from services.core.config import SpeculativeConfig
    from services.core.sampling_params import SamplingParams
    from services.core.tokenizer import Tokenizer

    load_before = loadavg()
    folder = model_folder(args.model)
    tokenizer = Tokenizer(folder)
    spec = SpeculativeConfig.of(args.spec)
    engine = {"num_gpu_blocks": 512} | ({"num_threads": args.num_threads} if args.num_threads else {})
    if args.activation_quant:
        engine["activation_quant"] = args.activation_quant
    off = LLM(str(folder), **engine)
    on = LLM(str(folder), **engine, speculative_config=spec)
    workloads = args.workloads.split(",")
    # the third engine only where a workload needs it (three engines beside other developers' jobs: memory)
    forced = LLM(str(folder), **engine,
                 speculative_config=SpeculativeConfig.of({**vars(spec), "disable_by_batch_size": 0})) \
        if "sharegpt-16" in workloads or "sweep" in workloads else None
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    greedy_batch = SamplingParams(temperature=0, max_tokens=args.batch_max_tokens)
    rows, data = [], {"spec": spec.to_json(), "workloads": {}}

    def record(name, result, batch, note=""):
        data["workloads"][name] = result
        rows.append([name, batch, f"{result['tok_s_off']:.1f}", f"{result['tok_s_on']:.1f}",
                     f"{result['speedup']:.2f}x", " ".join(f"{r:.2f}" for r in result["speedups"]),
                     f"{result['decode_speedup']:.2f}x",
                     f"{result['accepted']}/{result['drafted']}",
                     " ".join(f"{a:.2f}" for a in result["acceptance_per_pos"]),
                     f"{result['tokens_per_verify']:.2f}", f"{result['accepted_per_token']:.2f}",
                     "yes" if result["identical"] else "NO", note])
        print(rows[-1], flush=True)

    if "copy" in workloads:
        prompts = copy_prompts(tokenizer, args.num_prompts, args.seed)
        record("copy (code rename)", compare(off, on, prompts, greedy, args.repeats, batch=1), 1, "target 2x")
    if "quoting" in workloads:
        prompts = quoting_prompts(tokenizer, args.num_prompts, args.seed, args.max_prompt_len, args.sharegpt_path)
        record("quoting (ShareGPT multi-turn)", compare(off, on, prompts, greedy, args.repeats, batch=1), 1,
               "target 1.3x")
    ordinary = None
    if "sharegpt-16" in workloads or "sweep" in workloads:
        ordinary = sharegpt_requests(16, folder, args.seed, 256, args.max_tokens, args.sharegpt_path)
    if "sharegpt-16" in workloads:
        prompts = [r.prompt_ids for r in ordinary]
        record("sharegpt, default threshold", compare(off, on, prompts, greedy_batch, args.repeats, batch=16), 16,
               f"target >= 0.97x; drafting off at >= {spec.disable_by_batch_size} running")
        record("sharegpt, drafting forced", compare(off, forced, prompts, greedy_batch, args.repeats, batch=16), 16,
               "disable_by_batch_size=0")
    if "sweep" in workloads:
        for batch in (1, 2, 4, 8):
            prompts = [r.prompt_ids for r in ordinary[:max(batch, 4)]]
            record(f"sweep: sharegpt, drafting forced", compare(off, forced, prompts, greedy_batch, 1, batch=batch), batch,
                   "disable_by_batch_size=0")

    cost_lines = []
    if "cost" in workloads:
        k = spec.num_speculative_tokens
        ns = tuple(sorted({1, 2, 4, 5, 8, k + 1, 9}))
        cost = verify_cost(off, args.cost_context, tuple(int(b) for b in args.cost_batches.split(",")), ns,
                           args.cost_repeats)
        data["verify_cost"] = {str(b): {str(n): t for n, t in by_n.items()} for b, by_n in cost.items()}
        cost_rows = [[b, f"{by_n[1] * 1000:.1f}"] + [f"{by_n[n] / by_n[1]:.2f}x" for n in ns[1:]]
                     for b, by_n in cost.items()]
        cost_lines = ["", f"Cost of a verify pass vs a decode step (`cost`): one forward pass and its logits for `batch` "
                      f"sequences of {args.cost_context} tokens each running n rows at their end (n = 1: a decode "
                      f"step; n = k + 1: verifying k drafts), the model runner's own batch preparation, every shape "
                      f"alternated, median of {args.cost_repeats}.", "",
                      markdown_table(["batch", "1 row (ms)"] + [f"{n} rows / 1 row" for n in ns[1:]], cost_rows)]
        print(cost_lines[-1], flush=True)

    headers = ["workload", "batch", "tok/s off", "tok/s on", "speedup (median)", "per pass",
               "speedup after the first token", "accepted/drafted", "accepted by position",
               "tokens per verify", "accepted per output token", "same tokens", "note"]
    body = "\n".join([
        "Speculative decoding on vs off (bench/spec.py), the same engine and requests, passes alternated.",
        f"Speculative config: `{spec.to_json()}`. Greedy, max_tokens {args.max_tokens} (batch 1), "
        f"{args.batch_max_tokens} (sharegpt-16 and the sweep), "
        f"{args.repeats} alternated passes per workload (the sweep: 1).", "",
        "**The host was shared with other developers' builds and test runs during this run** (load average "
        "above): absolute tokens/s are noisy; the on/off ratios come from passes alternated within seconds.", "",
        markdown_table(headers, rows) if rows else "", *cost_lines])
    print(write_results(args.stem, "Speculative decoding (ngram), exact", load_before, body, data))


if __name__ == "__main__":
    main()
