#!/usr/bin/env bash
# One GPU machine's checks in one go, most important first, each under its own time limit inside the
# session's (BUDGET seconds, default 570), every result written to OUT as it comes:
#   1. bench/gpu.py (flexmesh against transformers and torchtitan, a FlexAttention candidate, a profiled step)
#   2. `flexmesh train` of TinyLlama-1.1B's shape on the stdlib corpus: where its wall time went, and how
#      long the process takes to exit after its last line
#   3. `pytest -m cuda`
#   4. `flexmesh demo` on this machine
#   5. `flexmesh serve bench --plan` on this GPU beside `serve simulate`'s price of the same plan
# Wheels the machine lacks (torchtitan and its needs: docs/benchmarks.md) go in .whl/ and are installed to
# a folder of their own. Run from the repository root: `OUT=/tmp/gpu bash bench/gpu_session.sh`.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/session.log
log() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
# the smaller of a step's own limit and what is left of the session (at least 1 s)
limit() { local left=$(( DEADLINE - $(date +%s) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
[ -f .commit ] && export FLEXMESH_BENCH_COMMIT=$(cat .commit)  # the tree's commit, where no .git came along
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE "^(torchtitan|liger-kernel|triton|flash)" ; df -h /tmp | tail -1; } >> "$LOG" 2>&1

log "1. bench/gpu.py"
timeout "$(limit ${T_BENCH:-300})" python3 -m bench.gpu --steps ${STEPS:-7} --trace --timeout 100 \
  --results "$OUT/bench.jsonl" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
log "bench exit $?"
tar czf "$OUT/records.tgz" bench/RESULTS.md bench/records 2>> "$LOG"

log "2. flexmesh train (stdlib corpus, ${MODEL:=tinyllama-1.1b}, planned for this machine)"
rm -rf /tmp/fm-run
start=$(date +%s.%N)
timeout "$(limit ${T_TRAIN:-110})" python3 -m flexmesh train --model "$MODEL" --seq-len 2048 --global-batch 32 \
  --corpus stdlib --max-steps ${TRAIN_STEPS:-10} --out /tmp/fm-run > "$OUT/train.txt" 2>&1
rc=$?
python3 - "$start" "$rc" >> "$LOG" 2>&1 <<'PY'
import sys, time
from pathlib import Path
run, end = Path("/tmp/fm-run"), time.time()
start, rc = float(sys.argv[1]), sys.argv[2]
files = [f for f in (run / "checkpoints").rglob("*") if f.is_file()] if (run / "checkpoints").exists() else []
metrics = run / "metrics.jsonl"
line = f"train exit {rc} after {end - start:.1f} s"
if metrics.exists():
    line += f"; exit {end - metrics.stat().st_mtime:.1f} s after the last step's metrics line"
if files:
    line += (f", {end - max(f.stat().st_mtime for f in files):.1f} s after the last checkpoint file; "
             f"checkpoints {sum(f.stat().st_size for f in files) / 2**30:.1f} GiB")
print(line)
PY
tail -c 3000 /tmp/fm-run/metrics.jsonl > "$OUT/train-metrics.jsonl" 2>/dev/null

log "3. pytest -m cuda"
timeout "$(limit ${T_CUDA:-150})" python3 -m pytest -q -m cuda -n 0 -p no:cacheprovider --durations=12 \
  > "$OUT/cuda.txt" 2>&1
log "cuda tests exit $?"

log "4. flexmesh demo"
timeout "$(limit ${T_DEMO:-480})" python3 -m flexmesh demo --out /tmp/fm-demo > "$OUT/demo.txt" 2>&1
log "demo exit $?"

log "5. serve bench --plan on this GPU (flexmesh's engine), beside serve simulate's price of the same plan"
# SERVE_MODEL: the plan's model (tinyllama-1.1b on the GPU); MAP_TO_CPU=1 runs the same steps on a machine without
# one (the CPU check of this script: GPU=H100-80GB SERVE_MODEL=tiny MAP_TO_CPU=1 bash bench/gpu_session.sh)
GPU=${GPU:-$(python3 -c "from flexmesh.serve.engine.local import local_gpus; g = local_gpus(); print(g[0] if g else '')")}
if [ -n "$GPU" ]; then
  SERVE="$OUT/serve"; mkdir -p "$SERVE"
  timeout "$(limit ${T_SERVE:-240})" bash -c "
    python3 -m flexmesh serve plan --model ${SERVE_MODEL:-tinyllama-1.1b} --cluster 1x$GPU --rate 8 --fit-context \
      --out $SERVE/plan > $SERVE/plan.txt 2>&1 || exit 1
    python3 -m flexmesh serve bench --plan $SERVE/plan/plan.json ${MAP_TO_CPU:+--map-to-cpu} \
      --rate ${SERVE_RATES:-4,16} --requests ${SERVE_REQUESTS:-100} --out $SERVE/bench > $SERVE/bench.txt 2>&1
    for e in transformers vllm; do
      for r in \$(echo ${SERVE_RATES:-4,16} | tr , ' '); do
        python3 -m flexmesh serve simulate --plan $SERVE/plan/plan.json --engine \$e --rate \$r --fit-context \
          --requests ${SERVE_REQUESTS:-100} > $SERVE/price-\$e-\$r.txt 2>&1
      done
    done"
  log "serve exit $?"
else
  log "serve: no CUDA device"
fi
