"""How a Tier 2 fetch cuts a large object into ranged GETs (``core.storage.s3.store.split_ranges``)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, strategies as st

from core.storage.s3.store import split_ranges

MiB = 1024 * 1024


def test_a_shard_just_over_two_ranges_is_two_gets_not_a_third_for_its_tail():
    shard = 16 * MiB + 184  # 16 MiB of tensors and a safetensors header
    assert split_ranges(shard, 8 * MiB) == [(0, 8 * MiB + 92), (8 * MiB + 92, 8 * MiB + 92)]


def test_small_and_empty_objects():
    assert split_ranges(0, 8 * MiB) == []
    assert split_ranges(1, 8 * MiB) == [(0, 1)]
    assert split_ranges(12 * MiB, 8 * MiB) == [(0, 6 * MiB), (6 * MiB, 6 * MiB)]


@given(size=st.integers(1, 2**36), range_bytes=st.integers(MiB, 64 * MiB))
def test_ranges_cover_the_object_once_in_order_and_stay_near_the_asked_size(size, range_bytes):
    ranges = split_ranges(size, range_bytes)
    assert ranges[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in pairwise(ranges))  # no gap, no overlap
    assert ranges[-1][0] + ranges[-1][1] == size
    lengths = [n for _, n in ranges]
    assert max(lengths) - min(lengths) <= 1  # equal within a byte
    if size >= range_bytes:  # what the threshold lets through: 2/3 to 3/2 of range_bytes each
        assert all(2 * range_bytes <= 3 * n + 3 and 2 * n <= 3 * range_bytes for n in lengths)
