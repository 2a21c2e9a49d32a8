"""vLLM as an offline contender, run by bench/offline.py inside vLLM's own venv (bench/install_vllm.sh):
it imports vllm and the standard library only, never the project.

    VENV/bin/python bench/vllm_peer.py --model FOLDER --dtype bfloat16 --requests requests.json

Loads the model once (the model folder's safetensors, in --dtype), then answers one line per line on
stdin: "run" generates every request of --requests (a JSON list of [prompt ids, output length]) in
one LLM.generate call, greedy, EOS ignored, and prints "VLLM_PEER {json}" with the output tokens and
the seconds; "quit" (or the end of stdin) ends it. Its first such line reports the versions once the
model is loaded. vLLM logs to stdout as well: the caller reads only the VLLM_PEER lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def say(**fields) -> None:
    print("VLLM_PEER " + json.dumps(fields), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True, choices=("float32", "bfloat16"))
    parser.add_argument("--requests", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
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
    say(ready=True, vllm=vllm.__version__, torch=torch.__version__, threads=torch.get_num_threads())
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        say(tokens=sum(len(o.outputs[0].token_ids) for o in outputs), seconds=seconds)


if __name__ == "__main__":
    main()
