"""Counting the bytes a promotion reads from Tier 0, kernel copies included: every store the
pipeline opens on a tier (``tasks.base.tier_store``) hands out readers that count ``read``,
``readinto`` and the ``copy_file_range`` steps the copy reports (``note_copied``), keeping
``fileno`` so the copy path measured is the real one. Used by benchmarks and tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tasks.base


class CountedReader:
    def __init__(self, inner: Any, key: str, seen: Counter):
        self.inner, self.key, self.seen = inner, key, seen

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.seen[self.key] += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self.inner.readinto(buf) or 0
        self.seen[self.key] += n
        return n

    def fileno(self) -> int:
        return self.inner.fileno()

    def note_copied(self, n: int) -> None:
        self.seen[self.key] += n

    def seek(self, *a: Any) -> int:
        return self.inner.seek(*a)

    def tell(self) -> int:
        return self.inner.tell()


@contextmanager
def counting_tier_reads(tier: int = 0) -> Iterator[Counter]:
    """While inside: a Counter of bytes read from ``tier`` by object key (its last segment)."""
    seen: Counter = Counter()
    real: Callable[..., Any] = tasks.base.tier_store

    def counting(settings: Any, t: int) -> Any:
        store = real(settings, t)
        if t == tier:
            opened = store.open_read

            @contextmanager
            def open_read(key: str) -> Iterator[CountedReader]:
                with opened(key) as fh:
                    yield CountedReader(fh, key.rsplit("/", 1)[-1], seen)

            store.open_read = open_read
        return store

    tasks.base.tier_store = counting
    try:
        yield seen
    finally:
        tasks.base.tier_store = real
