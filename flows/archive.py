"""archive_checkpoint: a milestone that is complete on Tier 1 goes to Tier 2, part by part.

The milestone rule (``core.policy.is_milestone``: tagged, epoch end, every K steps) decides;
without Tier 2 configured nothing happens. Each part is uploaded from Tier 1 (the cluster-wide
copy, so any node may archive) and proven on Tier 2 by the server's full-object checksums;
the first caller that sees every part verified there announces ``ckpt.checkpoint.archived``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import flow

from core import events
from core.errors import BadEvent
from core.events import announcing
from core.policy import is_milestone
from core.settings import Settings, load_settings
from flows.artifacts import artifact_key, publish_table
from flows.common import Steps, current_actor, hop_rows, task_steps
from tasks.base import HopResult, open_catalog
from tasks.prefect_events import emit
from tasks.register import checkpoint_args, reject_event


@dataclass
class ArchiveResult:
    run: str
    step: int
    milestone: bool
    hops: list[HopResult] = field(default_factory=list)
    archived: bool = False  # this call saw the checkpoint complete on Tier 2 first
    reason: str = ""

    def summary(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "milestone": self.milestone,
                "archived": self.archived, "reason": self.reason, "hops": hop_rows(self.hops)}


def archive(settings: Settings, run: str, step: int, *, steps: Steps, actor: str = "cli") -> ArchiveResult:
    """Upload a milestone's parts Tier 1 -> Tier 2 and verify them there; skip anything else."""
    with open_catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step)
    milestone = is_milestone(ck.kind, ck.step, ck.tags, settings.milestones)
    if not milestone:
        return ArchiveResult(run, step, milestone=False, reason="not a milestone")
    if not settings.tier2_url:
        return ArchiveResult(run, step, milestone=True, reason="tier 2 not configured")
    result = ArchiveResult(run, step, milestone=True)
    for part in range(ck.parts):
        result.hops += steps.tier2_hop(settings, run, step, part, actor=actor)
    result.archived = steps.mark_complete(settings, run, step, 2, actor=actor)
    if result.archived:
        events.announce(events.ARCHIVED, run, step, parts=ck.parts, node=settings.node,
               payload={"tier": 2, "bytes": ck.total_bytes, "url": settings.tier2_url})
    return result


@flow(name="archive-checkpoint", flow_run_name="archive/{run}/step-{step}")
def archive_checkpoint(run: str, step: int | str, node: str | None = None) -> dict:
    """Settings read once here; the steps run as Prefect tasks, each part's upload in this run's
    body (``task_steps``); a table artifact per archive.
    Parameters may arrive as strings (event trigger templates); a malformed one fails the run
    with a rejection audited in the catalog."""
    settings = load_settings(**({"node": node} if node else {}))
    actor = current_actor("event")
    try:
        run, step, _, _ = checkpoint_args(run, step)
    except BadEvent as exc:
        reject_event(settings, f"archive {run!r} step {step!r}", exc, actor=actor)
        raise
    with announcing(emit):
        result = archive(settings, run, step, steps=task_steps(settings), actor=actor)
    publish_table(artifact_key("archive", run, step), hop_rows(result.hops),
                  f"archive of {run} step {step}: {result.reason or 'uploaded to tier 2'}")
    return result.summary()
