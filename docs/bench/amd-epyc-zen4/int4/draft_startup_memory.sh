#!/bin/bash
# Peak resident memory of a draft worker's startup (load, GEMM path with its copies, calibration),
# --int4 off against the default (auto). Run from the repository root after `make setup`; prints
# VmHWM / VmRSS per setting. EMULATE_AVX2=1 caps torch, oneDNN and MKL at AVX2 (a float32 draft).
if [ "${EMULATE_AVX2:-0}" = 1 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
for int4 in off auto; do
  rm -f ${TMPDIR:-/tmp}/port-$int4
  .venv/bin/python -m draft_worker --model embedded:qwen2.5-coder-0.5b --device cpu --int4 $int4 --port 0 \
    --port-file ${TMPDIR:-/tmp}/port-$int4 > ${TMPDIR:-/tmp}/hwm-$int4.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do [ -s ${TMPDIR:-/tmp}/port-$int4 ] && break; sleep 1; done
  sleep 2
  echo "--int4 $int4: $(grep -E 'VmHWM|VmRSS' /proc/$pid/status | tr -s ' ' | tr '\n' ' ') $(grep -o 'copies [0-9]* MiB' ${TMPDIR:-/tmp}/hwm-$int4.log)"
  kill $pid; wait $pid 2>/dev/null
done
