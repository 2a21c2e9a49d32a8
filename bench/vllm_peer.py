"""vLLM as an offline contender, run by bench/offline.py inside vLLM's own venv (bench/install_vllm.sh):
it imports vllm and the standard library only, never the project.

    VENV/bin/python bench/vllm_peer.py --model FOLDER --dtype bfloat16 --requests requests.json

Loads the model once (the model folder's safetensors, in --dtype), then answers one line per line on
stdin: "run" generates every request of --requests (a JSON list of [prompt ids, output length]) in
one LLM.generate call, greedy, EOS ignored, and writes a JSON line with the output tokens and the
seconds to the file descriptor --answer-fd (default 1, stdout); "quit" (or the end of stdin) ends it.
Its first such line reports the versions once the model is loaded. vLLM's own logs go to stdout and
stderr: a caller that does not read them gives --answer-fd a pipe of its own and sends them to a file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def say(out, **fields) -> None:
    out.write(json.dumps(fields) + "\n")
    out.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, choices=("float32", "bfloat16"))
    parser.add_argument("--requests", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--answer-fd", type=int, default=1)
    args = parser.parse_args()
    out = os.fdopen(args.answer_fd, "w")
    with open(args.requests) as f:
        requests = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    say(out, ready=True, vllm=vllm.__version__, torch=torch.__version__, threads=torch.get_num_threads())
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        say(out, tokens=sum(len(o.outputs[0].token_ids) for o in outputs), seconds=seconds)


if __name__ == "__main__":
    main()
