#!/bin/bash
# Peak resident memory of a draft worker's startup (load, GEMM path with any weight copies, calibration),
# once per setting: each argument is one set of worker flags, e.g.
#   scripts/draft_startup_memory.sh "--int4 off" "--int4 auto"
# Run from the repository root after `make setup`; prints VmHWM / VmRSS once serving, and the size of the
# copies the worker logged, per setting. EMULATE_AVX2=1 caps torch, oneDNN and MKL at AVX2 (the draft is
# then float32 under --dtype auto). DRAFT_ENTRY: what runs the worker (default: -m draft_worker; e.g.
# scripts/draft_worker_int4_check_fails.py for the fallback to bf16 copies). The report folders under
# docs/bench/ call it with their settings.
if [ "${EMULATE_AVX2:-0}" = 1 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
n=0
for flags in "$@"; do
  n=$((n + 1))
  port=${TMPDIR:-/tmp}/draft-memory-port-$n log=${TMPDIR:-/tmp}/draft-memory-$n.log
  rm -f "$port"
  # $flags unquoted on purpose: one argument holds several flags.
  .venv/bin/python ${DRAFT_ENTRY:--m draft_worker} --model embedded:qwen2.5-coder-0.5b --device cpu $flags --port 0 \
    --port-file "$port" > "$log" 2>&1 &
  pid=$!
  for i in $(seq 1 120); do [ -s "$port" ] && break; sleep 1; done
  sleep 2
  echo "$flags: $(grep -E 'VmHWM|VmRSS' /proc/$pid/status | tr -s ' ' | tr '\n' ' ') $(grep -o '[a-z0-9]* copies [0-9]* MiB' "$log")"
  kill $pid; wait $pid 2>/dev/null
done
