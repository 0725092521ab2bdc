"""The golden retention cases (``tests/unit/retention_cases/*.json``) as plain facts, rules and
the expected plan, for the pure rule (unit test) and for the catalog (integration test).

A case: ``now``, ``policies`` (tier -> RetentionPolicy fields), ``milestones``, ``tier2_on``,
``keep_parents``, ``checkpoints`` (run, step, ``tiers`` holding every part, or ``replicas`` as
[tier, part] pairs, and optional kind, tags, metrics, parts, age_days, pinned, aliases,
children, state, locked_until of its Tier 2 copy; a metric may be ``"nan"``, ``"inf"`` or
``"-inf"``, as the catalog stores a non-finite one) and ``expect``: ``"run/step"`` ->
``"keep|retire: reason"`` and ``"run/step tier T[ part P]"`` -> ``"keep|demote|retire: reason"``,
one line per decision of the plan (the whole plan, nothing left out), and for each tier with a
budget (``max_bytes`` in its policy) ``"tier T budget"`` -> ``"within|over: K of M bytes kept"``
(over it: ``, held by RULE BYTES, ...``). Every copy is ``COPY_BYTES`` long, as the catalog kit
records one (``tests.kit.catalog.verified``).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from core.retention import CheckpointFacts, Plan, ReplicaFacts, Rules
from core.settings import MilestonePolicy, RetentionPolicy

COPY_BYTES = 2000
CASES = Path(__file__).resolve().parents[1] / "unit" / "retention_cases"


def case_files() -> list[Path]:
    return sorted(CASES.glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def now_of(case: dict) -> datetime:
    return datetime.fromisoformat(case["now"])


def rules_of(case: dict) -> Rules:
    return Rules(policies={int(t): RetentionPolicy(**p) for t, p in case["policies"].items()},
                 milestones=MilestonePolicy(**case.get("milestones", {})), tier2_on=case.get("tier2_on", False),
                 keep_parents=case.get("keep_parents", True))


def replica_pairs(c: dict) -> list[tuple[int, int]]:
    if "replicas" in c:
        return [tuple(p) for p in c["replicas"]]
    return [(t, p) for t in c.get("tiers", []) for p in range(c.get("parts", 1))]


def metrics_of(c: dict) -> dict[str, float]:
    return {k: float(v) for k, v in c.get("metrics", {}).items()}


def lock_of(c: dict) -> datetime | None:
    return datetime.fromisoformat(c["locked_until"]) if c.get("locked_until") else None


def facts_of(case: dict) -> list[CheckpointFacts]:
    now = now_of(case)
    out = []
    for i, c in enumerate(case["checkpoints"]):
        at = now - timedelta(days=c.get("age_days", 30))
        reps = tuple(ReplicaFacts(replica_id=i * 10 + t * 3 + p, tier=t, part=p, bytes=COPY_BYTES,
                                  locked_until=lock_of(c) if t == 2 else None) for t, p in replica_pairs(c))
        out.append(CheckpointFacts(run=c["run"], step=c["step"], created_at=at, committed_at=at,
                                   parts=c.get("parts", 1), kind=c.get("kind", "step"), tags=c.get("tags", {}),
                                   metrics=metrics_of(c), state=c.get("state", "committed"), replicas=reps,
                                   pinned=c.get("pinned", False), aliases=tuple(c.get("aliases", ())),
                                   children=tuple(c.get("children", ()))))
    return out


def rendered(plan: Plan, parts: dict[tuple[str, int], int]) -> dict[str, str]:
    """The plan as the case's ``expect`` writes it."""
    out = {f"{d.run}/{d.step}": f"{d.action}: {d.reason}" for d in plan.checkpoints}
    for d in plan.replicas:
        key = f"{d.run}/{d.step} tier {d.tier}" + (f" part {d.part}" if parts[(d.run, d.step)] > 1 else "")
        out[key] = f"{d.action}: {d.reason}"
    for b in plan.budgets:
        held = "".join(f", held by {r} {n}" if i == 0 else f", {r} {n}" for i, (r, n) in enumerate(b.held_by))
        where = f"tier {b.tier} budget" + (f" on {b.node}" if b.node else "")
        out[where] = f"{'over' if b.over else 'within'}: {b.kept_bytes} of {b.max_bytes} bytes kept{held}"
    return out


def parts_of(case: dict) -> dict[tuple[str, int], int]:
    return {(c["run"], c["step"]): c.get("parts", 1) for c in case["checkpoints"]}
