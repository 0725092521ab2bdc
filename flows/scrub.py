"""scrub flow: re-read a share of the stored copies, mark what rotted, repair it (scheduled by
``Settings.scrub_cron``; ``ckpt scrub`` runs the same step, ``tasks.scrub.scrub``, by hand).

Publishes a table of what was found and repaired, announces ``ckpt.checkpoint.corrupt`` for
each bad copy, and fails the run when something could not be repaired, so it shows red.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from core.errors import CorruptCheckpoint
from core.settings import load_settings
from flows.artifacts import artifact_key, publish_table
from flows.common import current_actor
from flows.restore import announce_bad
from tasks.scrub import ScrubReport, scrub_task


def scrub_rows(report: ScrubReport) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"what": "summary", "detail": report.summary()}]
    rows += [{"what": f"found {b.state}", "detail": f"{b.run}/step-{b.step} part {b.part} tier {b.tier}: {b.reason}"}
             for b in report.bad]
    rows += [{"what": "repaired" if r.ok else "NOT repaired",
              "detail": f"{r.run}/step-{r.step} part {r.part} tier {r.tier}: {r.detail}"} for r in report.repairs]
    rows += [{"what": "skipped", "detail": s} for s in report.skipped]
    return rows


@flow(name="scrub", flow_run_name="scrub", log_prints=True)
def scrub_flow(fraction: float | None = None, repair: bool = True) -> dict[str, Any]:
    """Re-read ``fraction`` of the verified durable copies (default ``Settings.scrub_fraction``).
    Settings are read here, from the environment: never a flow parameter (Prefect stores
    parameters with every run, in its database and UI)."""
    settings = load_settings()
    report = scrub_task(settings, fraction=fraction, repair=repair, actor=current_actor("scrub"))
    announce_bad(report.bad, "scrub")
    publish_table(artifact_key("scrub"), scrub_rows(report), report.summary())
    print(report.summary())
    if not report.ok:
        failed = [r for r in report.repairs if not r.ok]
        raise CorruptCheckpoint(f"{len(failed)} bad copies could not be repaired: "
                                + "; ".join(f"{r.run}/step-{r.step} tier {r.tier}: {r.detail}" for r in failed))
    return {"checked": report.checked, "eligible": report.eligible, "bad": len(report.bad),
            "repaired": sum(r.ok for r in report.repairs), "bytes_read": report.bytes_read}
