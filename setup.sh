#!/usr/bin/env bash
# Installs flexmesh and its test tools into the current Python environment (a venv if one is active).
# torch==2.13.0 first where torch is missing: any looser spec would pull the CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
start=$SECONDS
step() { echo "setup [$1/3, $((SECONDS - start)) s] $2"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  step 1 "installing torch 2.13.0 (the CPU build; a few hundred MB)"
  "$PY" -m pip install --quiet torch==2.13.0
else
  step 1 "torch $("$PY" -c 'import torch; print(torch.__version__)') is installed"
fi
step 2 "installing flexmesh and its test tools (pip install -e .[dev])"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# The oldest transformers the serve extra admits, beside the installed one, for the engine's test on both ends of
# the range (tests/test_serve_engine_versions.py), with the dependencies it pins (huggingface-hub 1.x; ~270 MB).
step 3 "installing transformers 5.17.0 into .venvs/transformers-5.17 (the engine's oldest admitted release)"
"$PY" -m pip install --quiet --disable-pip-version-check --upgrade --target .venvs/transformers-5.17 \
  transformers==5.17.0
echo "setup done in $((SECONDS - start)) s: try 'flexmesh --help', 'flexmesh demo' or 'python3 -m pytest -q'"
