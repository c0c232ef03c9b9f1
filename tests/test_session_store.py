from __future__ import annotations

from dataclasses import dataclass

from specdec.session_store import SessionStore


@dataclass
class Blob:
    size: int

    def nbytes(self) -> int:
        return self.size


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_eviction_over_byte_budget() -> None:
    store: SessionStore[Blob] = SessionStore(max_bytes=100, ttl_s=60)
    for name in "abcd":
        store.put(name, Blob(30))
    store.get("a")  # a is now most recently used
    evicted = store.enforce_budget(extra_bytes=0)
    assert evicted == ["b"] and store.total_bytes() == 90
    assert store.enforce_budget(extra_bytes=40) == ["c"]  # 60 held + 40 incoming fits exactly
    assert store.enforce_budget(extra_bytes=41) == ["d"]


def test_pinned_sessions_are_not_evicted() -> None:
    store: SessionStore[Blob] = SessionStore(max_bytes=50, ttl_s=60)
    store.put("a", Blob(40))
    store.put("b", Blob(40))
    store.pin("a")
    assert store.enforce_budget() == ["b"]
    assert not store.fits(20)  # a (pinned, 40) + 20 > 50
    assert store.fits(50, exclude="a")  # a growing to 50 bytes itself fits
    store.unpin("a")


def test_ttl_expiry() -> None:
    clock = Clock()
    store: SessionStore[Blob] = SessionStore(max_bytes=1000, ttl_s=10, clock=clock)
    store.put("old", Blob(1))
    clock.now = 5
    store.put("new", Blob(1))
    clock.now = 12
    assert store.get("old") is None and store.get("new") is not None
    assert store.evictions == 1


def test_max_sessions() -> None:
    store: SessionStore[Blob] = SessionStore(max_bytes=10**9, ttl_s=60, max_sessions=2)
    for name in "abc":
        store.put(name, Blob(1))
    assert store.enforce_budget() == ["a"] and len(store) == 2
