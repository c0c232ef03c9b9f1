"""Token-prefix hashing shared by orchestrator and workers to detect a cache that drifted."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def prefix_hash(tokens: Sequence[int]) -> int:
    """64-bit hash of a token sequence; 0 for the empty sequence."""
    if not tokens:
        return 0
    data = array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
