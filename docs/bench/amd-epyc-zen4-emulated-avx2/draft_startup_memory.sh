#!/bin/bash
# The figures in docs/deploy.md (AVX2 kernels emulated): a float32 draft's startup memory without copies
# (--dtype float32) against bf16 copies (--dtype auto; measured on a42e7b0, before the int4 copies, which
# --int4 off rules out now). Run from the repository root after `make setup`.
EMULATE_AVX2=1 exec scripts/draft_startup_memory.sh "--dtype float32" "--dtype auto --int4 off"
