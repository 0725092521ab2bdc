"""Whole checkpoints' bandwidths (``core.tier_figures.checkpoint_bandwidths``, ``ckpt plan``'s
write bandwidth): a checkpoint's parts copy side by side, so its bandwidth is all its bytes over
the span from its first part's start to its last part's end."""

from __future__ import annotations

import pytest

from core.tier_figures import checkpoint_bandwidths


def test_parts_side_by_side_add_up_and_parts_one_after_another_do_not():
    gb = 10**9
    side_by_side = [("a", gb, 1.0, 10.0), ("a", gb, 1.0, 10.0)]  # both from 9 s to 10 s
    overlapping = [("b", gb, 1.0, 10.0), ("b", gb, 1.0, 10.5)]  # 9 s to 10.5 s
    one_after_another = [("c", gb, 1.0, 10.0), ("c", gb, 1.0, 11.0)]  # 9 s to 11 s

    assert checkpoint_bandwidths(side_by_side).median == pytest.approx(2 * gb)
    assert checkpoint_bandwidths(overlapping).median == pytest.approx(2 * gb / 1.5)
    assert checkpoint_bandwidths(one_after_another).median == pytest.approx(gb)
    together = checkpoint_bandwidths(side_by_side + overlapping + one_after_another + [("d", gb, 0.0, 5.0)])
    assert (together.count, together.median, together.p95) == (3, pytest.approx(2 * gb / 1.5), pytest.approx(gb))
    assert checkpoint_bandwidths([]) is None
