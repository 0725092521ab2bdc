"""restore_drill flow: the scheduled restoration drill (``Settings.drill_cron``).

Restores the newest milestone from Tier 1 and from Tier 2 into an empty scratch folder, checks
it, records the recovery time per tier in the catalog, publishes the figures as a table
artifact and cleans up (``tasks.drill``). A failed drill fails the run after recording it.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from core.errors import CorruptCheckpoint
from core.settings import load_settings
from flows.common import artifact_key, current_actor, publish_table
from tasks.drill import restore_drill_task


@flow(name="restore-drill", flow_run_name="restore-drill", log_prints=True)
def restore_drill(run: str | None = None, scratch: str | None = None) -> list[dict[str, Any]]:
    """Drill the newest milestone (of ``run``, or of any run) on Tier 1 and Tier 2."""
    settings = load_settings()  # from the environment, never a flow parameter
    report = restore_drill_task(settings, run=run, scratch=scratch, actor=current_actor("drill"))
    rows = report.rows() + [{"tier": None, "ok": None, "detail": s} for s in report.skipped]
    title = (f"restore drill of {report.run}/step-{report.step}" if report.step is not None
             else "restore drill: nothing to drill")
    publish_table(artifact_key("restore-drill"), rows, title)
    for r in report.rows():
        print(f"tier {r['tier']}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s ({r['MB/s']} MB/s) {r['detail']}")
    for s in report.skipped:
        print(s)
    if not report.ok:
        raise CorruptCheckpoint("restore drill failed: " + "; ".join(
            f"tier {r.tier}: {r.detail}" for r in report.results if not r.ok))
    return report.rows()
