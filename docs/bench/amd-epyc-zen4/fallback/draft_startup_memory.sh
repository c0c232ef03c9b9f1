#!/bin/bash
# The draft worker's startup peak memory under emulated AVX2 kernels (a float32 draft): int4 copies
# kept; int4 copies dropped by a forced failing check, then bf16 copies (the fallback); --int4 off.
# From the repository root: bash docs/bench/amd-epyc-zen4/fallback/draft_startup_memory.sh
export EMULATE_AVX2=1
bash scripts/draft_startup_memory.sh "--int4 auto"
DRAFT_ENTRY=scripts/draft_worker_int4_check_fails.py bash scripts/draft_startup_memory.sh "--int4 auto"
bash scripts/draft_startup_memory.sh "--int4 off"
