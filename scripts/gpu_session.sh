#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): every GPU figure the issues ask for, in stages,
# each capped so that the whole stays inside BUDGET_S; results packed into $OUT/results.tgz after
# every stage, so a stage cut short still returns what came before it.
#
#   device run, carry [".whl"]:  bash scripts/gpu_session.sh
#
# The real weights cannot travel (64 MiB a call; the embedded pair is 1.4 GB of GGUF), so the models
# are random weights at the real shapes (tiny:preset=..., specdec.model_refs): the target is
# Qwen2.5-1.5B's shapes with its last four layers quietened, the draft the same model cut to its first
# 24 layers (a 0.5B-class layer count, which is what sets an eager step's cost on a GPU). Their greedy
# agreement is set by construction (gpu_costs.py measures it), not a real pair's.
set -u
OUT=${OUT:-/tmp/gpu-out}
RES=${RES:-/tmp/gpu-results}
BUDGET_S=${BUDGET_S:-480}
TARGET=${TARGET:-tiny:preset=qwen2.5-1.5b,seed=1,quiet_from=24,quiet=0.3}
DRAFT=${DRAFT:-tiny:preset=qwen2.5-1.5b,seed=1,layers=24}
DEVICE=${DEVICE:-cuda}     # DEVICE=cpu PRESETS=... TARGET=tiny:... DRAFT=tiny:... : a dry run of the plumbing
PRESETS=${PRESETS:-qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-1.5b@24,qwen2.5-7b}
CPU_TARGET=${CPU_TARGET:-tiny:preset=qwen2.5-1.5b,seed=1}   # the embedded pair's shapes, on the host CPU
CPU_DRAFT=${CPU_DRAFT:-tiny:preset=qwen2.5-0.5b,seed=1}
STAGES=${STAGES:-decode_graph attention costs ragged flips loadtest loadtest32 netbench cpu_paths bench}
START=$(date +%s)
mkdir -p "$OUT" "$RES"

# worker_startup ROLE MODEL: a worker started on the host's CPU (2 threads, as the 2-core machines
# have) until it serves, then stopped: its log holds the GEMM path it chose per shape and its cost
# curve (issue 14 asks which path each CPU takes; this host is an Intel with AMX).
worker_startup() {
    local role=$1 model=$2 port="$RES/cpu-$1.port"
    rm -f "$port"
    python3 -m "${role}_worker" --model "$model" --device cpu --threads 2 --calibration-s 20 --port 0 \
        --port-file "$port" &
    local pid=$!
    while kill -0 $pid 2>/dev/null && [ ! -s "$port" ]; do sleep 1; done
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
    [ -s "$port" ]
}
cpu_paths() {
    worker_startup target "$CPU_TARGET" && worker_startup draft "$CPU_DRAFT"
}

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
pack() { tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null; }
# stage NAME CAP_S COMMAND...: runs with the smaller of CAP_S and the time left, logs to $RES/NAME.log.
stage() {
    local name=$1 cap=$2; shift 2
    local budget=$(( $(left) - 15 ))
    (( cap < budget )) && budget=$cap
    if (( budget < 30 )); then echo "== $name: skipped, $(left) s left"; return; fi
    echo "== $name (up to $budget s, $(left) s left)"
    timeout -k 5 "$budget" "$@" > "$RES/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc after $(( $(date +%s) - START )) s"
    tail -n 25 "$RES/$name.log"
    pack
    return $rc
}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
    date -u; nvidia-smi; lscpu | grep -E 'Model name|^CPU\(s\)'
    python3 -c "import sys, torch, transformers, grpc, google.protobuf as pb; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('transformers', transformers.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
} > "$RES/env.txt" 2>&1
cat "$RES/env.txt"
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" in
    *H200*) BW=4.8 ;; *H100*) BW=3.35 ;; *) BW=0 ;;
esac

want() { [[ " $STAGES " == *" $1 "* ]]; }
# First: the draft's decode graph (--decode-graph, on by default for a draft on CUDA) in a worker core:
# captured and checked, its step against an eager one, greedy through it. Where it fails the stages
# after would measure eager drafts again: stop, and keep the device time for a fixed rerun.
if want decode_graph; then
    stage decode_graph 120 python3 scripts/decode_graph_costs.py --device "$DEVICE" \
        --models "$DRAFT|tiny:preset=qwen2.5-0.5b,seed=1|$TARGET" --out "$RES/decode_graph.json" \
        || { pack; echo "decode graph stage failed after $(( $(date +%s) - START )) s"; exit 1; }
fi
# Whether new attention shapes cost a cuDNN graph build each (the 2026-11-27 k > 0 slowness),
# each setting in its own process; the other stages run with the default (off).
want attention && stage attention 90 bash -c 'for c in on off; do python3 scripts/attention_shapes.py --model "$0" \
    --device "$1" --cudnn $c --out "$2/attention-$c.json" || exit 1; done' "$TARGET" "$DEVICE" "$RES"
want costs && stage costs 120 python3 scripts/gpu_costs.py --device "$DEVICE" --presets "$PRESETS" --out "$RES/costs" \
    --bandwidth-tbs "$BW" --pair "$TARGET|$DRAFT"
want ragged && stage ragged 60 python3 scripts/ragged_steps.py --model "$TARGET" --device "$DEVICE" \
    --out "$RES/ragged.json"
want flips && stage flips 60 python3 -m specdec.cli flips --model "$TARGET" --device "$DEVICE" \
    --dtypes bfloat16,float32 --k 4 --new-tokens 48 --max-prompts 4 --out "$RES/flips.json"
want loadtest && stage loadtest 170 python3 -m specdec.cli loadtest --sweep 1,2,4,8 --target "$TARGET" --draft "$DRAFT" \
    --requests-per-stream 2 --max-new-tokens 64 --worker-args "--calibration-s 8" --out "$RES/loadtest"
# The exact mode under batching on the GPU (issue 17, item 3): float32 on both workers (the packed
# flash kernel has no float32, so attention runs per session), 1 and 8 streams: "differs from alone"
# says whether batched forwards flip any greedy output where bf16's near-ties are out of the way.
want loadtest32 && stage loadtest32 150 python3 -m specdec.cli loadtest --sweep 1,8 --target "$TARGET" --draft "$DRAFT" \
    --requests-per-stream 2 --max-new-tokens 64 --worker-args "--calibration-s 8 --dtype float32" --out "$RES/loadtest32"
NETBENCH_LATENCIES=${NETBENCH_LATENCIES:-0,10}   # issue 16's four: 0,2,10,25 (about 45 s each)
NETBENCH_CAP=${NETBENCH_CAP:-150}
want netbench && stage netbench "$NETBENCH_CAP" python3 -m specdec.cli netbench --target "$TARGET" --draft "$DRAFT" \
    --latencies-ms "$NETBENCH_LATENCIES" \
    --max-prompts 3 --max-new-tokens 48 --systems 'pipelined$' --threads 4 --target-cpus 0-7 --draft-cpus 8-15 \
    --calibration-s 5 --out "$RES/netbench"
export -f worker_startup cpu_paths
export RES CPU_TARGET CPU_DRAFT
want cpu_paths && stage cpu_paths 100 bash -c cpu_paths
want bench && stage bench 200 python3 -m specdec.cli bench --device "$DEVICE" --target "$TARGET" --draft "$DRAFT" --modes greedy \
    --max-new-tokens 64 --systems 'HF in-process|HF assisted \(default\)|fixed k=4|cost \(server' --out "$RES/bench"
pack
echo "done after $(( $(date +%s) - START )) s"
