"""What a tier delivers and costs, as pure arithmetic over what the catalog recorded (``ckpt
tiers``, the storage section of a run's status page, ``ckpt plan``'s measured bandwidths).

Bandwidths are per hop (one part's copy, its read-back included, or one restore drill), except
``ckpt plan``'s write bandwidth, a whole checkpoint's (``checkpoint_bandwidths``): the
median, and the p95 as the bandwidth 95 % of the hops reached at least (the slow tail, the one
that stalls a promotion). First-byte latency's p95 is the plain 95th percentile (the slow tail
again). Percentiles are by nearest rank: a value some hop really measured.

Costs are decimal GB-months (1 GB = 1e9 bytes, as storage is priced) at the tier's price.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

from core.sizing import fmt_bytes, fmt_seconds

GB = 1e9
WINDOW_SECONDS = 86_400.0  # the hops the figures cover: the last day


@dataclass(frozen=True)
class Spread:
    """The median and the p95 of one figure over ``count`` hops."""

    median: float
    p95: float
    count: int


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 < q <= 1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def spread(values: Sequence[float], *, slow_is_low: bool) -> Spread | None:
    """``values``' median and p95 (None for none); ``slow_is_low`` for a bandwidth, whose slow
    tail is its low end: its p95 is then the 5th percentile (what 95 % of hops reached)."""
    if not values:
        return None
    return Spread(median(values), nearest_rank(values, 0.05 if slow_is_low else 0.95), len(values))


def bandwidths(timings: Sequence[tuple[int, float]]) -> Spread | None:
    """The spread of bytes per second over ``(bytes, seconds)`` hops."""
    return spread([b / s for b, s in timings if s > 0], slow_is_low=True)


def checkpoint_bandwidths(copies: Sequence[tuple[object, int, float, float]]) -> Spread | None:
    """The spread of whole checkpoints' bandwidths over ``(checkpoint, bytes, seconds, ended)``
    copies (``ended`` in seconds on any one clock): each checkpoint's bytes, all its parts
    together, over the span from its first part's copy start to its last one's end. The parts
    of a multi-node checkpoint copy side by side, so its bandwidth is their sum, not one hop's;
    a one-part checkpoint's is its hop's."""
    spans: dict[object, list[float]] = {}
    for checkpoint, nbytes, seconds, ended in copies:
        if seconds <= 0:
            continue
        got = spans.setdefault(checkpoint, [0.0, math.inf, -math.inf])
        got[0] += nbytes
        got[1] = min(got[1], ended - seconds)
        got[2] = max(got[2], ended)
    return spread([b / (last - first) for b, first, last in spans.values() if last > first], slow_is_low=True)


def dedup_ratio(logical_bytes: int, stored_bytes: int) -> float | None:
    """Logical over stored bytes (1.0: every byte stored once per copy); None when nothing is stored."""
    return logical_bytes / stored_bytes if stored_bytes > 0 else None


def monthly_cost(stored_bytes: int, price_per_gb_month: float) -> float:
    """What ``stored_bytes`` cost a month at ``price_per_gb_month``."""
    return stored_bytes / GB * price_per_gb_month


def budget_used(stored_bytes: int, budget_bytes: int | None) -> float | None:
    """The share of the tier's byte budget in use (above 1.0: over budget); None without one."""
    return stored_bytes / budget_bytes if budget_bytes else None


def fmt_bandwidth(bytes_per_s: float) -> str:
    return fmt_bytes(bytes_per_s) + "/s"


def fmt_latency(seconds: float) -> str:
    """Milliseconds below a second (a first byte on a healthy tier), else seconds."""
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else fmt_seconds(seconds)


def fmt_spread(s: Spread | None, fmt: Callable[[float], str]) -> str:
    """``median / p95 (hops)``; '—' where no hop measured it."""
    return "—" if s is None else f"{fmt(s.median)} / {fmt(s.p95)} ({s.count})"
