"""The hops of one part as single steps: ``tier1_hop``, the fast hop of a promotion (register ->
copy to Tier 1, verifying Tier 0 in the same read -> complete), and
``tier2_hop``, a part's archive (upload to Tier 2 -> verify it there).

Each piece is its own plain step (``register_stored_part``, ``promote_part``, ``mark_complete``),
idempotent and claimed in the catalog, so the hop is one unit of retry: a retry registers
again (a no-op), re-reads Tier 0 and finds the copy done or takes it over. ``promote_part``
reads Tier 0 once: the copy checks every byte against the manifest on its way to Tier 1 and
that is the Tier 0 verify (``tasks.copy``); the hop list still shows both. As one step it runs
inline under the task policy (``flows.common.task_steps``; the node's agent runs a part's with no
flow run at all: ``flows.promote.promote_in_agent``), never as a task run of its own: a task run
costs the flow round trips and the server its ingest (a task run record and three state events),
which a burst pays once per node. What each piece did is in the hop list the flow publishes.
``tier2_hop`` (a part of a milestone's archive, run by the one caller that takes the
checkpoint's follow-ups) runs the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from core.settings import Settings
from core.transfer import run_at
from db.entities import CKPT_SUPERSEDED, COPYING
from tasks.base import HopResult, copy_priority, open_catalog
from tasks.copy import promote_part, upload_to_tier2
from tasks.record import mark_complete
from tasks.register import register_stored_part
from tasks.retry import pipeline_task
from tasks.verify import verify_replica


@dataclass
class Tier1Hop:
    checkpoint_id: int
    parts: int
    hops: list[HopResult] = field(default_factory=list)
    durable: bool = False  # this call recorded the checkpoint complete on Tier 1 (its follow-ups: flows.promote)


def tier1_hop(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
              node: str | None = None, actor: str = "cli", attempt: str = "") -> Tier1Hop:
    """Make one part durable on Tier 1; ``durable`` is true for exactly one caller per checkpoint.

    All of it (catalog, format check, copy) runs at the agent's copy priority (``copy_nice``,
    ``copy_io_class``): the training job on the node keeps its cores."""
    return run_at(copy_priority(settings), lambda: _tier1_hop(settings, run, step, part, parts, node=node,
                                                              actor=actor, attempt=attempt))


def _tier1_hop(settings: Settings, run: str, step: int, part: int, parts: int, *,
               node: str | None, actor: str, attempt: str) -> Tier1Hop:
    reg = register_stored_part(settings, run, step, part, parts, node=node, actor=actor, attempt=attempt)
    result = Tier1Hop(reg.checkpoint_id, reg.parts)
    if reg.state == CKPT_SUPERSEDED:  # a late part of an older attempt: its Tier 0 copy recorded for
        # retention to retire, never copied on (a newer attempt resumed from below its step)
        result.hops.append(verify_replica(settings, run, step, part, tier=0, node=node, actor=actor, attempt=attempt))
        return result
    if reg.promoted:  # a repeated or concurrent event: this part is already on Tier 1
        result.hops.append(HopResult(hop="tier 0 -> tier 1", run=run, step=step, part=part, files=reg.files,
                                     bytes=reg.bytes, seconds=0.0, skipped=True))
    else:
        result.hops.extend(promote_part(settings, run, step, part, node=node, actor=actor, attempt=attempt))
    result.durable = mark_complete(settings, run, step, 1, actor=actor, attempt=attempt)
    return result


def tier2_hop(settings: Settings, run: str, step: int, part: int = 0, *, node: str | None = None,
              actor: str = "cli") -> list[HopResult]:
    """Upload one part Tier 1 -> Tier 2 and verify it there (by the server's full-object
    checksums); a part already verified there is a skipped hop."""
    hop = upload_to_tier2(settings, run, step, part, node=node, actor=actor)
    if hop.skipped:
        return [hop]
    return [hop, verify_replica(settings, run, step, part, tier=2, node=node, actor=actor)]


tier1_hop_task = pipeline_task(tier1_hop, name="tier0-to-tier1")
tier2_hop_task = pipeline_task(tier2_hop, name="tier1-to-tier2")


def tier1_hop_rows(settings: Settings, run: str, step: int, checkpoint_id: int) -> list[dict[str, Any]]:
    """Every part's Tier 0 -> Tier 1 hop of the checkpoint as the catalog holds it, one row per
    part, for its promote run's hop table: the parts were promoted by their nodes' agents with no
    run of their own, so this is where the UI shows them, under their checkpoint. ``attempts``
    counts the claims of the part's Tier 1 copy (a retry, or another worker taking a stalled copy
    over, claims it again); each retry's reason is a line of that node's agent log."""
    with open_catalog(settings.catalog_url) as cat:
        replicas = cat.replicas(checkpoint_id, tier=1)
        nodes = {r.part: r.node for r in cat.replicas(checkpoint_id, tier=0)}  # where each was promoted from
        claims = Counter(e.subject for e in cat.history(run, step) if e.to_state == COPYING)
    rows = []
    for rep in sorted(replicas, key=lambda r: r.part):
        hop = HopResult(hop="tier 0 -> tier 1", run=run, step=step, part=rep.part, files=0, bytes=rep.bytes or 0,
                        seconds=rep.copy_seconds or 0.0)
        row = hop.row()
        del row["files"], row["skipped"]
        rows.append({**row, "node": nodes.get(rep.part) or "", "state": rep.state,
                     "attempts": claims[f"replica:{rep.id}"]})
    return rows
