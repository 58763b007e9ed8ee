#!/usr/bin/env bash
# Installs flexmesh and its test tools into the current Python environment.
# torch==2.13.0 first where torch is missing: any looser spec would pull the CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e ".[dev]"
