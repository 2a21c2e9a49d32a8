#!/usr/bin/env bash
# The one prepared check for a lent CUDA GPU (refuses to run without one). Sections, in order:
#   env        device name, compute capability, driver, torch, triton, commit
#   compile    python -m services.tools.gpu_compile for this device's architecture: the full matrix the
#              suite checks on a CPU (a subset there), now with the device's own ptxas limits in view
#   tests      the kernel tests on the GPU (compiled kernels, fp16 included, the CPU tiers of this host
#              too) and the CUDA worker contract (tests/worker/test_cuda_worker_contract.py: its stubbed
#              tests, and the real swap through the pinned pool on the copy streams)
#   features   bench/gpu_features.py on the GPU, bf16, the Triton kernels: seeded sampling (twice, alone
#              vs batched), --device cuda:N, the kernel backends (triton, torch), async scheduling,
#              structured outputs, quantized weights (auto on a GPU, int8 refused), and the kernel
#              variants the JIT compiled against those gpu_compile planned
#   kernels    each Triton kernel timed against its PyTorch reference and the bytes-moved floor
#              (bench/kernel_bench.py: Llama-3.2-1B shapes, batch 1..256, context 128..4096)
#   offline    offline throughput on a ~1B random-weight Llama, bf16: the engine on the Triton kernels,
#              its plain (non-invariant) path, transformers' static batching (GPU_CHECK_OFFLINE=full:
#              256 requests of 512+128 tokens; default: 64 requests of 256+64, to fit a short lease)
# Writes bench/results/gpu_check.md (the summary, the test log's tail, the kernel tables),
# gpu_compile_sm<NN>.md, gpu_features.{md,json}, gpu_offline.{md,json}.
#   bash bench/gpu_check.sh                       # every section
#   bash bench/gpu_check.sh compile tests         # some; PYTHON=/path/to/python picks the interpreter
# Exit status: non-zero if any section failed (each still runs; the summary names them). Not yet run
# on a GPU: none has been lent to this project.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels, not the interpreter

SECTIONS=("$@")
[[ ${#SECTIONS[@]} -eq 0 ]] && SECTIONS=(env compile tests features kernels offline)

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
SUMMARY=$(mktemp)
trap 'rm -f "$TEST_LOG" "$SUMMARY"' EXIT
ARCH=$("$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'sm_{major}{minor}')")
JOBS=$(nproc 2>/dev/null || echo 4)
failed=()

run_section() {  # name, then the command; records its status and time in the summary
  local name=$1 start rc
  shift
  echo "== $name"
  start=$(date +%s)
  "$@"
  rc=$?
  echo "| $name | $([[ $rc -eq 0 ]] && echo pass || echo "FAIL (rc=$rc)") | $(( $(date +%s) - start )) s |" >> "$SUMMARY"
  [[ $rc -eq 0 ]] || failed+=("$name")
}

section_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "$PYTHON" - <<'PY'
import subprocess, torch, triton
print(f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, capability {torch.cuda.get_device_capability()}, "
      f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, commit "
      + subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
PY
}

section_compile() {
  case "$ARCH" in
    sm_80|sm_86|sm_89|sm_90)
      "$PYTHON" -m services.tools.gpu_compile --arch "$ARCH" --jobs "$JOBS" --out "$RESULTS/gpu_compile_$ARCH.md" \
        | tail -4
      return "${PIPESTATUS[0]}" ;;
    *) echo "gpu_compile knows no shared-memory limit for $ARCH: skipped"; return 0 ;;
  esac
}

section_tests() {
  "$PYTHON" -m pytest tests/kernels tests/worker/test_cuda_worker_contract.py -q -rs -p no:cacheprovider 2>&1 | tee "$TEST_LOG"
  return "${PIPESTATUS[0]}"
}

section_features() {
  "$PYTHON" bench/gpu_features.py --device cuda --dtype bfloat16
}

section_kernels() {
  "$PYTHON" bench/kernel_bench.py --out "$RESULTS/gpu_check_kernels.md" --tests-log "$TEST_LOG"
}

section_offline() {
  local model=${MODEL_1B:-/tmp/pagedserve-llama-1b} size=(--input-len 256 --output-len 64 --num-requests 64)
  [[ ${GPU_CHECK_OFFLINE:-} == full ]] && size=(--input-len 512 --output-len 128 --num-requests 256)
  [[ -f "$model/config.json" ]] || "$PYTHON" -m services.tools.make_model --size 1b --out "$model" || return 1
  "$PYTHON" bench/offline.py --model "$model" --dataset random "${size[@]}" --max-num-seqs 256 \
    --max-num-batched-tokens 8192 --dtypes bfloat16 --modes engine,engine-plain,hf-batch \
    --hf-batch-sizes 16,64,256 --out gpu_offline
}

for section in "${SECTIONS[@]}"; do
  if ! declare -F "section_$section" >/dev/null; then
    echo "gpu_check: unknown section $section (env compile tests features kernels offline)" >&2
    exit 2
  fi
  run_section "$section" "section_$section"
done

{
  echo "# GPU check"
  echo
  echo "\`bash bench/gpu_check.sh ${SECTIONS[*]}\` on $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())') ($ARCH), $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD)."
  echo
  echo "| section | result | time |"
  echo "|---|---|---|"
  cat "$SUMMARY"
  if [[ -s "$TEST_LOG" ]]; then
    echo; echo "## Tests (tail)"; echo; echo '```'; tail -25 "$TEST_LOG"; echo '```'
  fi
  if [[ -f "$RESULTS/gpu_check_kernels.md" ]]; then
    echo; cat "$RESULTS/gpu_check_kernels.md"
  fi
} > "$RESULTS/gpu_check.md"
rm -f "$RESULTS/gpu_check_kernels.md"
echo "== wrote $RESULTS/gpu_check.md; failed: ${failed[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
