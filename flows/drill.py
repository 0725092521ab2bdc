"""drill_flow (Prefect flow ``restore-drill``): the scheduled recovery drill (``Settings.drill_cron``).

For the run of the newest milestone (or ``run``), on Tier 1 and on Tier 2: the newest
checkpoint held whole there is resumed by one process per part at once, cold, each part loaded
with its format's loader and checked (``tasks.drill.cluster_drill``); the cluster RTO, each
node's time, bytes per tier and the bound are recorded in the catalog, published as a table
artifact and on the run's status page. A failed drill fails the run after recording it; so does
a drill that found nothing to drill (no milestone, no tier holding one whole).
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from core.errors import CorruptCheckpoint
from core.settings import load_settings
from flows.artifacts import artifact_key, publish_table
from flows.common import current_actor
from flows.status import publish_run_status
from tasks.drill import DRILL_TIERS, cluster_drill_task, require_drilled


@flow(name="restore-drill", flow_run_name="restore-drill", log_prints=True)
def drill_flow(run: str | None = None, scratch: str | None = None, nodes: int | None = None,
               tiers: list[int] | None = None) -> list[dict[str, Any]]:
    """Drill ``run`` (default: the newest milestone's run) on each of ``tiers`` (1 and 2) with
    ``nodes`` processes (default: the checkpoint's parts)."""
    settings = load_settings()  # from the environment, never a flow parameter
    drills, skipped = cluster_drill_task(settings, run=run, nodes=nodes, tiers=tuple(tiers or DRILL_TIERS),
                                         scratch=scratch, actor=current_actor("drill"))
    rows = [d.row() for d in drills]
    drilled = drills[0].result if drills else None
    title = (f"recovery drill of {drilled.run}, {drilled.nodes} node(s)" if drilled
             else "recovery drill: nothing to drill")
    flat = [{k: (json.dumps(v) if isinstance(v, dict | list) else v) for k, v in r.items()} for r in rows]
    publish_table(artifact_key("restore-drill"), flat + [{"tier": None, "ok": None, "detail": s} for s in skipped],
                  title)
    if drilled is not None:
        publish_run_status(settings, drilled.run)
    for r in rows:
        print(f"tier {r['tier']} step {r['step']}, {r['nodes']} node(s): {'ok' if r['ok'] else 'FAILED'}, "
              f"RTO {r['rto_seconds']} s, bound {r['bound_seconds']} s {r['detail']}")
    for s in skipped:
        print(s)
    require_drilled(drills, skipped)
    failed = [d.result for d in drills if not d.result.ok]
    if failed:
        raise CorruptCheckpoint("restore drill failed: " + "; ".join(f"tier {r.tier}: {r.detail}" for r in failed))
    return rows
