"""restore_flow (Prefect flow ``restore-checkpoint``): the restore of ``tasks.restore`` as a Prefect run,
announced.

Named ``restore/<run>`` in the UI. It announces ``ckpt.checkpoint.corrupt`` for every copy the
restore proved bad and ``ckpt.checkpoint.restored`` for the result, and publishes a table of
what it used (tier, bytes, seconds, throughput, every fallback). Failures propagate: a
checkpoint with no good copy fails the run with the reasons.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from core import events
from core.settings import load_settings
from flows.artifacts import artifact_key, publish_table
from flows.common import current_actor
from tasks.prefect_events import emit
from tasks.replicas import DEFAULT_PREFERENCE, BadReplica
from tasks.restore import RestoreReport, restore_task


def announce_bad(bad: list[BadReplica], source: str) -> None:
    """One ``ckpt.checkpoint.corrupt`` event per replica a read proved bad."""
    for b in bad:
        emit(events.CORRUPT, b.run, b.step, part=b.part, extra_id=f"{source}-tier{b.tier}-r{b.replica_id}",
                    payload={"tier": b.tier, "state": b.state, "reason": b.reason, "found_by": source})


def restore_rows(report: RestoreReport) -> list[dict[str, Any]]:
    rows = [{"what": "restored", "run": report.run, "step": report.step, "tiers": sorted(set(report.tiers)),
             "bytes": report.bytes, "files": report.files, "seconds": round(report.seconds, 3),
             "MB/s": round(report.mb_per_s, 1), "dest": report.dest}]
    rows += [{"what": "note", "detail": note} for note in report.notes]
    return rows


@flow(name="restore-checkpoint", flow_run_name="restore/{run}", log_prints=True)
def restore_flow(run: str, dest: str, step: int | None = None,
                 preference: list[int] | None = None) -> dict[str, Any]:
    """Restore ``run`` (newest verified, or ``step``) into ``dest`` from the nearest good copy."""
    settings = load_settings()  # from the environment, never a flow parameter
    report = restore_task(settings, run, dest, step=step, preference=tuple(preference or DEFAULT_PREFERENCE),
                          actor=current_actor("restore"))
    announce_bad(report.bad, "restore")
    emit(events.RESTORED, report.run, report.step, node=settings.node,
                extra_id=f"{report.dest}|{report.seconds}",
                payload={"tiers": sorted(set(report.tiers)), "bytes": report.bytes, "dest": report.dest,
                         "seconds": round(report.seconds, 3), "fell_back_from": report.fell_back_from})
    publish_table(artifact_key("restore", run), restore_rows(report), report.summary())
    print(report.summary())
    for note in report.notes:
        print(note)
    return {"run": report.run, "step": report.step, "tiers": report.tiers, "bytes": report.bytes,
            "seconds": report.seconds, "notes": report.notes, "dest": report.dest}
