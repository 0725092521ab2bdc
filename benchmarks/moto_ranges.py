"""moto's S3 server, answering a ranged GET from the range's bytes alone (for the benchmarks).

moto answers a ranged GET by reading the whole object out of its buffer and slicing the range
from that copy (``S3Response.get_object`` returns ``FakeKey.value``, all of it;
``_handle_range_header`` slices it), so a 32 MiB object fetched as four 8 MiB ranges costs the
server four 32 MiB reads: a ranged reader pays the server CPU for four times its bytes, where
S3 serves a range at the cost of the range. In front of this server, ``s3_shaper.py`` gives
each connection S3's bandwidth and first-byte latency; with this patch a range also costs the
server what its bytes cost, so the raw read that measures the bound (one GET per object) and a
ranged fetch of the same bytes ask the server for the same work.

The patch: while a GET carries one well-formed range that starts inside the object
(``bytes=A-B`` or ``bytes=A-``), ``FakeKey.value`` gives a ``_Lazy`` view whose length is the
object's and whose slices are read from the object's buffer on demand, so moto's own range
handling (its bounds, 206, Content-Range, 416) runs unchanged and reads only the slice it takes.
Any other GET (no range, a suffix range, several ranges, one past the end) takes moto's path as
it is. The object's bytes are never changed, so a reader still checks what it got.

    python benchmarks/moto_ranges.py -H 127.0.0.1 -p PORT     # moto.server's own arguments
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moto.s3 import models, responses

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_hint = threading.local()  # the range of the GET this thread is answering, until its value is read


class _Lazy:
    """The object's bytes as moto's range handling sees them: its length, and a slice read
    from the object's buffer only when taken."""

    def __init__(self, key: Any) -> None:
        self._key = key

    def __len__(self) -> int:
        return int(self._key.size)

    def __getitem__(self, item: slice) -> bytes:
        start, stop, step = item.indices(len(self))
        if step != 1:
            raise TypeError("only contiguous slices of an object's bytes")
        with self._key.lock:
            buf = self._key._value_buffer
            buf.seek(start)
            return buf.read(max(0, stop - start))


def _value(key: Any) -> Any:
    begin = getattr(_hint, "begin", None)
    _hint.begin = None  # this GET's one read of the value
    if begin is not None and begin < key.size:
        return _Lazy(key)
    return _whole(key)


def _whole(key: Any) -> bytes:
    """moto's own ``FakeKey.value``: the whole object, copied."""
    return _whole_value(key)


def _get_object(self: Any) -> Any:
    m = _RANGE.fullmatch(self.headers.get("range") or "")
    _hint.begin = int(m.group(1)) if m and (not m.group(2) or int(m.group(2)) >= int(m.group(1))) else None
    try:
        return _original_get_object(self)
    finally:
        _hint.begin = None


_whole_value = models.FakeKey.value.fget
_original_get_object = responses.S3Response.get_object


@contextmanager
def patched() -> Iterator[None]:
    """moto patched in this process (its server's request handlers run here), restored on exit."""
    value, get_object = models.FakeKey.value, responses.S3Response.get_object
    models.FakeKey.value = property(_value, value.fset)
    responses.S3Response.get_object = _get_object
    try:
        yield
    finally:
        models.FakeKey.value, responses.S3Response.get_object = value, get_object


if __name__ == "__main__":
    import sys

    from moto.server import main

    print("moto_ranges: each ranged GET is served from the range's bytes", file=sys.stderr, flush=True)
    with patched():
        main()
