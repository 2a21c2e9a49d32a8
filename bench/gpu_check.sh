#!/usr/bin/env bash
# One prepared GPU check for the Triton kernels (needs a CUDA device; refuses to run without one):
#   1. the kernel tests on the GPU (compiled kernels, fp16 included, the gpu-marked tests),
#   2. each kernel timed against its PyTorch reference and the bytes-moved floor at
#      Llama-3.2-1B-shaped sizes (batch 1..256, context 128..4096), with max errors,
#   3. a seeded sampled request on the GPU worker (the sampler on CUDA tensors): the same tokens
#      twice, and alone vs in a batch,
#   4. the offline throughput benchmark on a ~1B random-weight Llama (bf16): the engine on
#      the Triton kernels, its plain (non-invariant) path, and transformers' static batching.
# Writes bench/results/gpu_check.md (tests summary, tables, raw JSON) and
# bench/results/gpu_offline.{md,json}.
#   bash bench/gpu_check.sh                 # PYTHON=/path/to/python to pick the interpreter
# Exit status: non-zero if the tests failed or the benchmark did not complete.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels, not the interpreter

PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
  for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
      PYTHON=$candidate; break
    fi
  done
fi
if [[ -z "$PYTHON" ]]; then
  echo "gpu_check: no python with a CUDA-enabled torch found (set PYTHON=...)" >&2
  exit 2
fi
"$PYTHON" -c "import triton" || { echo "gpu_check: triton not importable by $PYTHON" >&2; exit 2; }

RESULTS=bench/results
mkdir -p "$RESULTS"
TEST_LOG=$(mktemp)
trap 'rm -f "$TEST_LOG"' EXIT

echo "== kernel tests on $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())')"
"$PYTHON" -m pytest tests/kernels -m "not slow or slow" -q -rs -p no:cacheprovider 2>&1 | tee "$TEST_LOG"
tests_rc=${PIPESTATUS[0]}

echo "== kernel timings"
"$PYTHON" bench/kernel_bench.py --out "$RESULTS/gpu_check.md" --tests-log "$TEST_LOG"
bench_rc=$?

echo "== seeded sampled requests on the GPU worker"
SAMPLE_MODEL=$(mktemp -d)
"$PYTHON" -m services.tools.make_model --size tiny --out "$SAMPLE_MODEL" >/dev/null
"$PYTHON" - "$SAMPLE_MODEL" <<'PY'
import sys
from services import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", seed=0)
params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=24, ignore_eos=True)
prompt = [[5, 17, 42, 9]]
one = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
batch = llm.generate(prompt + [[7, 8, 9]] * 7, params, use_tqdm=False)[0].outputs[0].token_ids
print("seeded sample:", one)
assert one == again == batch, (one, again, batch)
print("seeded sampling on cuda: same tokens twice and in a batch of 8")
PY
sample_rc=$?
rm -rf "$SAMPLE_MODEL"

echo "== offline throughput, ~1B random-weight Llama, bf16"
MODEL_1B=${MODEL_1B:-/tmp/pagedserve-llama-1b}
[[ -f "$MODEL_1B/config.json" ]] || "$PYTHON" -m services.tools.make_model --size 1b --out "$MODEL_1B"
"$PYTHON" bench/offline.py --model "$MODEL_1B" --dataset random --input-len 512 --output-len 128 \
  --num-requests 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --dtypes bfloat16 \
  --modes engine,engine-plain,hf-batch --hf-batch-sizes 16,64,256 --out gpu_offline
offline_rc=$?

echo "== wrote $RESULTS/gpu_check.md, $RESULTS/gpu_offline.md (tests rc=$tests_rc, bench rc=$bench_rc, sample rc=$sample_rc, offline rc=$offline_rc)"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 && $sample_rc -eq 0 && $offline_rc -eq 0 ]]
