#!/usr/bin/env bash
# One GPU machine's checks in one go, most important first, each under its own time limit inside the
# session's (BUDGET seconds, default 570), every result written as it comes:
#   bench  bench/gpu.py (flexmesh against transformers and torchtitan, a profiled step of flexmesh and of
#          torchtitan); alone on the machine
#   cuda   `pytest -m cuda` and `flexmesh demo` on this machine, side by side (neither is a timed figure
#   demo   beyond its own wall time, which the log gives each)
#   serve  `flexmesh serve bench --plan` on this GPU beside `serve simulate`'s price of the same plan; alone
#   train  `flexmesh train` of TinyLlama-1.1B's shape on the stdlib corpus: where its wall time went, and how
#          long the process takes to exit after its last line
# PARTS picks and orders them (default "bench cuda+demo serve train"; a "+" runs two side by side).
# Everything lands in WORK (default /tmp/gpu-session) and is packed into OUT/session.tgz after each part
# and every 30 s meanwhile (a device call returns at most 8 files); OUT/session.log is the log.
# Wheels the machine lacks (torchtitan and its needs: docs/benchmarks.md) go in .whl/ and are installed to
# a folder of their own. Run from the repository root: `OUT=/tmp/gpu bash bench/gpu_session.sh`.
set -u
OUT=${OUT:-/tmp/gpu-session-out}
WORK=${WORK:-/tmp/gpu-session}
mkdir -p "$OUT" "$WORK"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/session.log
log() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
pack() { tar czf "$OUT/.session.tgz" -C "$WORK" . 2>/dev/null; mv -f "$OUT/.session.tgz" "$OUT/session.tgz"; }
records() { tar czf "$WORK/bench-records.tgz" bench/RESULTS.md bench/records 2>> "$LOG"; }
( while sleep 30; do records; pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; records; pack' EXIT
# the smaller of a step's own limit and what is left of the session (at least 1 s)
limit() { local left=$(( DEADLINE - $(date +%s) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
[ -f .commit ] && export FLEXMESH_BENCH_COMMIT=$(cat .commit)  # the tree's commit: the git folder that travels can be older
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE "^(torchtitan|liger-kernel|triton|flash)" ; df -h /tmp | tail -1; } >> "$LOG" 2>&1

# each part: "<name> exit <rc> after <s> s" in the log
timed() { local name=$1 s; shift; s=$(date +%s); "$@"; log "$name exit $? after $(( $(date +%s) - s )) s"; }

part_bench() {
  timeout "$(limit ${T_BENCH:-420})" python3 -m bench.gpu --steps ${STEPS:-7} --trace --timeout 100 \
    --cases ${CASES:-2048,8192,mix} --results "$WORK/bench.jsonl" ${BENCH_ARGS:-} > "$WORK/bench.txt" 2>&1
}

part_cuda() {
  timeout "$(limit ${T_CUDA:-200})" python3 -m pytest -q -m cuda -n 0 -p no:cacheprovider --durations=12 \
    > "$WORK/cuda.txt" 2>&1
}

part_demo() {
  OMP_NUM_THREADS=${DEMO_OMP:-3} timeout "$(limit ${T_DEMO:-480})" python3 -m flexmesh demo --out /tmp/fm-demo > "$WORK/demo.txt" 2>&1
}

part_train() {
  rm -rf /tmp/fm-run
  local start rc
  start=$(date +%s.%N)
  timeout "$(limit ${T_TRAIN:-110})" python3 -m flexmesh train --model "${MODEL:-tinyllama-1.1b}" --seq-len 2048 \
    --global-batch 32 --corpus stdlib --max-steps ${TRAIN_STEPS:-10} --out /tmp/fm-run ${TRAIN_ARGS:-} \
    > "$WORK/train.txt" 2>&1
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
  tail -c 3000 /tmp/fm-run/metrics.jsonl > "$WORK/train-metrics.jsonl" 2>/dev/null
  return "$rc"
}

# SERVE_MODEL: the plan's model (tinyllama-1.1b on the GPU); MAP_TO_CPU=1 runs the same steps on a machine without
# one (the CPU check of this script: GPU=H100-80GB SERVE_MODEL=tiny MAP_TO_CPU=1 PARTS=serve bash bench/gpu_session.sh)
part_serve() {
  local gpu=${GPU:-$(python3 -c "from flexmesh.serve.engine.local import local_gpus; g = local_gpus(); print(g[0] if g else '')")}
  [ -n "$gpu" ] || { log "serve: no CUDA device"; return 1; }
  local serve="$WORK/serve"
  mkdir -p "$serve"
  timeout "$(limit ${T_SERVE:-240})" bash -c "
    python3 -m flexmesh serve plan --model ${SERVE_MODEL:-tinyllama-1.1b} --cluster 1x$gpu --rate 8 --fit-context \
      --out $serve/plan > $serve/plan.txt 2>&1 || exit 1
    python3 -m flexmesh serve bench --plan $serve/plan/plan.json ${MAP_TO_CPU:+--map-to-cpu} \
      --rate ${SERVE_RATES:-4,16} --requests ${SERVE_REQUESTS:-100} --out $serve/bench > $serve/bench.txt 2>&1
    for e in transformers vllm; do
      for r in \$(echo ${SERVE_RATES:-4,16} | tr , ' '); do
        python3 -m flexmesh serve simulate --plan $serve/plan/plan.json --engine \$e --rate \$r --fit-context \
          --requests ${SERVE_REQUESTS:-100} > $serve/price-\$e-\$r.txt 2>&1
      done
    done"
}

for step in ${PARTS:-bench cuda+demo serve train}; do
  log "$step (load $(cut -d' ' -f1-3 /proc/loadavg))"
  pids=()
  for name in ${step//+/ }; do
    timed "$name" "part_$name" &
    pids+=($!)
  done
  wait "${pids[@]}"
  records
  pack
done
