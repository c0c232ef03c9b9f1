#!/bin/bash
# What the draft worker's startup chooses, alone: its GEMM path (which shapes got int4 copies, what
# the distribution check kept) and its cost curve, one torch thread pinned to one CPU (netbench's
# setting). Stops the worker once the cost curve is logged.
#   scripts/draft_startup_plan.sh LOG [CALIBRATION_S (20)] [CPU (1)]
# docs/adaptive-k.md ("Fewer shapes"); reports in docs/bench/amd-epyc-zen4/draft-startup/.
set -u
log=$1
calibration_s=${2:-20}
cpu=${3:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
export SPECDEC_MODELS_DIR=${SPECDEC_MODELS_DIR:-$root/.models}
cd "$root"
taskset -c "$cpu" "$root/.venv/bin/python" -m draft_worker --model embedded:qwen2.5-coder-0.5b --threads 1 \
    --calibration-s "$calibration_s" --port 0 > "$log" 2>&1 &
pid=$!
for _ in $(seq 1 120); do
    sleep 2
    grep -q 'cost curve' "$log" && break
    kill -0 $pid 2>/dev/null || break
done
kill $pid 2>/dev/null
wait $pid 2>/dev/null
grep -E 'copies|GEMM path|cost curve' "$log" | cut -c1-900
