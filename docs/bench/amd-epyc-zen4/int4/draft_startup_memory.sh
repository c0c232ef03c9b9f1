#!/bin/bash
# The figures in draft_startup_memory.txt: a draft worker's startup memory with --int4 off against the
# default (auto), on this CPU and with EMULATE_AVX2=1. Run from the repository root after `make setup`.
exec scripts/draft_startup_memory.sh "--int4 off" "--int4 auto"
