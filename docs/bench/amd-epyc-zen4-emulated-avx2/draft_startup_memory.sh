#!/bin/bash
# Peak resident memory of a draft worker's startup (load, GEMM path, calibration), per --dtype.
# Run from the repository root after `make setup`; prints VmHWM / VmRSS per --dtype.
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
for dt in float32 auto; do
  rm -f ${TMPDIR:-/tmp}/port-$dt
  .venv/bin/python -m draft_worker --model embedded:qwen2.5-coder-0.5b --device cpu --dtype $dt --port 0 --port-file ${TMPDIR:-/tmp}/port-$dt > ${TMPDIR:-/tmp}/hwm-$dt.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do [ -s ${TMPDIR:-/tmp}/port-$dt ] && break; sleep 1; done
  sleep 2
  echo "$dt: $(grep -E 'VmHWM|VmRSS' /proc/$pid/status | tr -s ' ' | tr '\n' ' ')"
  kill $pid; wait $pid 2>/dev/null
done
