"""The draft worker with its first check of weight copies forced to fail (score 0.5), so that a
float32 draft on a CPU without native bf16 takes the fallback to bf16 copies (linear_path.choose_and_apply)
as a draft whose int4 copies lose its distributions would. For measuring that startup (its peak
memory: scripts/draft_startup_memory.sh with DRAFT_ENTRY=scripts/draft_worker_int4_check_fails.py);
every later check is the real one.

    python scripts/draft_worker_int4_check_fails.py --model embedded:qwen2.5-coder-0.5b --device cpu --port 0
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec import calibration  # noqa: E402

honest = calibration.reduced_overlap
calls: list[int] = []


def first_fails(*args: object, **kwargs: object) -> float:
    calls.append(1)
    return 0.5 if len(calls) == 1 else honest(*args, **kwargs)  # type: ignore[arg-type]


calibration.reduced_overlap = first_fails  # type: ignore[assignment]
runpy.run_module("draft_worker", run_name="__main__", alter_sys=True)
