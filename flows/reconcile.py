"""reconcile: make the catalog agree with what the tiers hold, and finish what events missed.

Runs every ``reconcile_interval_seconds`` on each node, in a child of its agent as plain code
(``reconcile_pass``; deployments/reconcile_loop.py), and on demand (``ckpt reconcile``: the
``reconcile`` flow). A node's agent (``--node-only``) leaves the cluster's share of steps 1, 3b,
4 and 6 (the object store, the backlogs, the shared tiers' retirements) to the cluster agent's
pass (``reconcile_once``'s ``cluster``). A pass leaves a flow run, ``reconcile/<node>``, only
when it acted (``ReconcileReport.acted``) or failed otherwise than the last run showed
(``decide``): the usual pass finds nothing, a failure that lasts fails every pass the same way, and one run per node a
minute would bury the promotions on the Runs page (and cost the orchestrator a run per node a
minute). In order:
0. claims whose worker died are recovered: a replica ``copying`` past its lease (a killed copy
   or verify) is re-checked against its files, as a verify does: ``verified`` when they read
   back whole, else ``missing`` (or ``corrupt``) so promotion acts again; one ``pruning`` past its lease is
   taken over by the guarded prune, which re-runs the whole guard and then finishes it or
   gives the copy back (Tier 0 only for this node's own NVMe);
1. replicas the catalog calls ``verified`` whose manifest or files vanished (Tier 0 of this
   node, Tier 1, Tier 2) become ``missing``: a bounded slice per tier per pass
   (``reconcile_check_limit``), in rotation, so a pass costs the same at any catalog size;
2. parts committed on this node's Tier 0 that the catalog does not know, or that were never
   (or no longer, after step 1) verified on Tier 1, are promoted (in the agent's own pass, a
   part the catalog does not know yet is left to its completed event while it is younger than
   the interval: ``young_parts``);
3. parts committed on Tier 1 that the catalog does not know are registered from their Tier 1
   manifest, verified in place and recorded (a catalog restored from an older backup): a
   bounded share of Tier 1 per pass, run folder by run folder, in rotation; in the run folders
   it looks at on Tiers 0 and 1, the stage folders of dead fetches and the tombstones of claims
   that are over (a fenced delete whose worker died or lost its claim: ``tasks.base.delete_part``)
   are removed;
   then checkpoints complete on Tier 1 whose follow-ups (archive, durable event, status page,
   retention) no promotion finished, because it was killed after recording the completion,
   get them (``flows.promote.follow_up``, under the follow-ups' lease);
4. milestones complete on Tier 1 but not on Tier 2 are archived;
5. this node's Tier 0 retention is applied: retention after a promotion runs on the node
   that completed the checkpoint and can only delete its own NVMe, so every other node's
   Tier 0 copies are pruned here (through the same guarded prune);
6. retirements a crash interrupted are finished: the copies left of a retired checkpoint (its
   retirement was recorded before its first byte went) are deleted under claims, audited.
What the catalog says of the parts found committed (steps 2, 3) is one set-based read, and
the archive backlog (step 4) one query: a pass's queries grow with what it finds to do, not
with what the catalog holds. A part of a run the catalog does not know yet is promoted like any other (registering it
creates the run). Parts of checkpoints already found corrupt, and parts whose manifest the
catalog already rejected are left alone (and listed), so a bad checkpoint is not re-rejected on
every pass; a re-saved part (another manifest) is tried again. One failing item never
stops the others; failures are listed in the report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from prefect import flow
from prefect.settings import get_current_settings

from core.errors import CkptError, CopyInProgress, CorruptCheckpoint, NotFound, PruneRefused
from core.events import announcing
from core.settings import Settings, load_settings
from core.tiers import readable_from
from core.transfer import committed_at
from db.entities import CKPT_SUPERSEDED, COPYING, PRUNING, CheckpointInfo, ReplicaInfo
from flows.archive import archive
from flows.artifacts import artifact_batch, artifact_key, publish_table
from flows.common import Steps, current_actor, inline_steps, task_steps
from flows.promote import PromoteResult, crash_followups_run, follow_up, promote
from flows.status import publish_run_status
from tasks.base import log, open_catalog, open_tier, sweep_tombs
from tasks.prefect_events import emit
from tasks.reconcile import (
    FAILURE,
    ReconcileReport,
    adoption_slice,
    archive_backlog,
    attempt,
    each,
    followups_backlog,
    mark_missing,
    parts_todo,
    replica_item,
    sweep_writer_staging,
    young_parts,
)
from tasks.record import claim_followups
from tasks.resume import sweep_dead_stages
from tasks.retention import FAILED, PRUNED, REFUSED, apply_retention, finish_retirements


def promotion_row(result: PromoteResult) -> dict[str, Any]:
    """One promotion as the reconcile run's artifact shows it: which checkpoint, and the tiers
    it now has a verified copy on, by this promotion (``0 -> 1``, ``0 -> 1 -> 2`` for a
    milestone archived inline)."""
    hops = result.hops + (result.archive.hops if result.archive else [])
    tiers = sorted({int(t) for h in hops for t in re.findall(r"tier (\d)", h.hop)})
    return {"run": result.run, "step": result.step, "part": result.part, "tiers": " -> ".join(map(str, tiers)),
            "durable": result.durable, "files": sum(h.files for h in hops if "->" in h.hop),
            "bytes": sum(h.bytes for h in hops if "->" in h.hop)}


def reconcile_once(settings: Settings, *, steps: Steps, actor: str = "cli", grace_seconds: float = 0.0,
                   on_durable: Callable[[PromoteResult], None] | None = None,
                   event_seconds: float = 0.0, cluster: bool = True) -> ReconcileReport:
    """One pass of the sweeps above on this node (``on_durable``: as for ``promote``). A part
    committed on Tier 0 less than ``event_seconds`` ago that the catalog has not registered is
    left to its completed event (the agent's own pass: ``reconcile_pass``). Without ``cluster``
    (the pass of a node's agent, ``ckpt agent --node-only``) the pass leaves the cluster's share
    to the cluster agent's pass: the object store's vanished copies (step 1), the follow-ups
    nobody finished and the archive backlog (steps 3b, 4) and the copies of interrupted
    retirements off this node's NVMe (step 6). Those are cluster-wide, so one pass covers them
    for every node; a thousand nodes no longer list the bucket every interval, and a node's agent
    never loads the S3 client at rest (a lapsed claim on Tier 2, step 0, is still re-checked by
    the first pass that finds it)."""
    report = ReconcileReport()
    recover_claims(settings, report, steps=steps, actor=actor)
    mark_missing(settings, report, actor=actor, object_store=cluster)
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, 0) as tier0, \
            open_tier(settings, 1) as tier1:
        committed0 = list(committed_at(tier0))
        todo0 = parts_todo(cat, tier0, [found for found, _ in committed0], report, tier=0,
                           grace_seconds=grace_seconds, actor=actor, young=young_parts(committed0, event_seconds))
        visited: list[str] = []
        todo1 = parts_todo(cat, tier1, adoption_slice(cat, tier1, settings.reconcile_check_limit, visited), report,
                           tier=1, grace_seconds=grace_seconds, actor=actor)
        for tier, store, runs in ((0, tier0, tier0.folders()), (1, tier1, visited)):
            each(report, f"tier {tier} stages", lambda store=store, runs=runs, tier=tier: _swept_stages(
                report, tier, sweep_dead_stages(cat, store, runs, node=settings.node, actor=actor)))
            each(report, f"tier {tier} tombstones", lambda store=store, runs=runs, tier=tier: _swept_tombs(
                report, tier, sweep_tombs(cat, store, runs, actor=actor)))
    sweep_writer_staging(settings, report, actor=actor)
    kw = dict(actor=actor)
    for run, step, part, parts, att in todo0:
        attempt(report, report.promoted, f"{run}/{step} part {part}",
                 lambda: report.promotions.append(promotion_row(
                     promote(settings, run, step, part, parts, steps=steps, node=settings.node,
                             on_durable=on_durable, attempt=att, **kw))))
    for run, step, part, parts, att in todo1:
        attempt(report, report.adopted, f"{run}/{step} part {part}",
                 lambda: _adopt(settings, run, step, part, parts, steps=steps, attempt=att, **kw))
    for ck in followups_backlog(settings, report, grace_seconds=grace_seconds) if cluster else ():
        attempt(report, report.followed_up, f"{ck.run}/{ck.step}",
                 lambda ck=ck: _follow_up(settings, ck, steps=steps, actor=actor, on_durable=on_durable))
    for run, step in archive_backlog(settings) if cluster else ():
        attempt(report, report.archived, f"{run}/{step}",
                 lambda: archive(settings, run, step, steps=steps, **kw))
    prune_own_tier0(settings, report, steps=steps, **kw)
    finish_retirements_into(report, settings, steps=steps, node=None if cluster else settings.node, **kw)
    return report


def _swept_stages(report: ReconcileReport, tier: int, removed: int) -> None:
    if removed:
        report.recovered.append(f"tier {tier}: {removed} stage folder(s) a killed resume's fetch left, removed")


def _swept_tombs(report: ReconcileReport, tier: int, removed: int) -> None:
    if removed:
        report.recovered.append(f"tier {tier}: {removed} tombstone(s) of claims that are over, removed")


def recover_claims(settings: Settings, report: ReconcileReport, *, steps: Steps, actor: str) -> None:
    """Step 0: settle every claim whose lease lapsed (by the catalog's clock). Idempotent: a
    claim that was settled or renewed meanwhile is left alone."""
    with open_catalog(settings.catalog_url) as cat:
        stuck = cat.expired_claims()
        lapsed = [rep for rep in stuck if rep.state == COPYING
                  and each(report, replica_item(rep), lambda rep=rep: cat.expire_copy_claim(rep.id, actor=actor))]
    for rep in lapsed:  # each re-check is its own item: an unexpected error fails only it
        state = each(report, replica_item(rep), lambda rep=rep: _recheck(settings, rep, steps=steps, actor=actor))
        if state is not None:
            report.recovered.append(f"{replica_item(rep)}: stalled copy -> {state}")
    for rep in [r for r in stuck if r.state == PRUNING]:
        item = replica_item(rep)
        if not readable_from(rep.tier, rep.node, settings.node) or not settings.tier_url(rep.tier):
            continue  # another node's NVMe: its own reconcile takes it over
        try:
            steps.prune(settings, rep.id, actor=actor, reason="stalled prune taken over by reconcile")
            report.recovered.append(f"{item}: stalled prune finished")
        except PruneRefused as exc:
            report.recovered.append(f"{item}: stalled prune given up: {exc}")
        except Exception as exc:  # noqa: BLE001 - one failing item never stops the pass
            log.warning("reconcile: stalled prune of %s: %s", item, exc, exc_info=not isinstance(exc, CkptError),
                        extra={FAILURE: True})
            report.failed.append(f"{item}: {type(exc).__name__}: {exc}")


def _follow_up(settings: Settings, ck: CheckpointInfo, *, steps: Steps, actor: str,
               on_durable: Callable[[PromoteResult], None] | None) -> None:
    """Step 3b: run the follow-ups of a checkpoint complete on Tier 1 that nobody finished (its
    promotion was killed after recording the completion), under their lease. Its promote run,
    when one was left ``Pending`` or ``Running`` by the process that died, is then ``Crashed``
    with a message saying who finished it (the follow-ups' lease was free: nobody runs it)."""
    if not claim_followups(settings, ck.id):
        raise CopyInProgress(f"follow-ups of {ck.run}/{ck.step} taken by another caller meanwhile")
    follow_up(settings, PromoteResult(ck.run, ck.step, 0, ck.parts, ck.id), steps=steps, node=settings.node,
              actor=actor, on_durable=on_durable)
    crash_followups_run(ck.run, ck.step, ck.attempt, f"its process ended before the run did; {actor} finished the "
                        f"checkpoint's follow-ups at {_when(time.time())}")


def _recheck(settings: Settings, rep: ReplicaInfo, *, steps: Steps, actor: str) -> str:
    """The state of a replica whose copy or verify claim lapsed, by its files: a killed verify
    of an intact copy leaves a copy that is still there (and on Tier 0 would hold the node's
    disk for good if it stayed ``missing``: retention prunes only verified copies), so it is
    read back against its manifest like any verify; ``missing`` when it cannot be read here
    (another node's NVMe: that node's reconcile re-checks it) or is not whole."""
    if not readable_from(rep.tier, rep.node, settings.node) or not settings.tier_url(rep.tier):
        return "missing (re-checked by the node that holds it)"
    try:
        steps.verify(settings, rep.run, rep.step, rep.part, tier=rep.tier, node=rep.node or None, actor=actor)
        return "verified (its files read back against the manifest)"
    except CorruptCheckpoint as exc:
        return f"corrupt ({exc})"
    except NotFound as exc:
        return f"missing ({exc})"
    except CkptError as exc:  # could not be read now: missing, and the next promotion or pass acts on it
        log.warning("reconcile: re-check of %s failed: %s", replica_item(rep), exc)
        return f"missing (re-check failed: {type(exc).__name__}: {exc})"


def prune_own_tier0(settings: Settings, report: ReconcileReport, *, steps: Steps, actor: str) -> None:
    """Apply Tier 0 retention to the replicas on this node's NVMe (step 5)."""
    if not settings.retention(0).lets_go:
        return
    plan = steps.plan_retention(settings, tiers=(0,), node=settings.node)
    for action in apply_retention(settings, plan, prune=steps.prune, actor=actor):
        item = f"tier 0 {action.run}/{action.step} part {action.part}"
        if action.outcome == PRUNED:
            report.pruned.append(item)
        elif action.outcome == FAILED:
            report.failed.append(f"{item}: {action.detail}")


def finish_retirements_into(report: ReconcileReport, settings: Settings, *, steps: Steps, actor: str,
                            node: str | None = None) -> None:
    """Delete what interrupted retirements left (step 6): every copy of a retired checkpoint,
    on Tier 1 and 2 and on this node's Tier 0 (another node's NVMe is its own reconcile's); with
    ``node``, only that node's Tier 0 copies (``tasks.retention.finish_retirements``)."""
    for action in finish_retirements(settings, prune=steps.prune, actor=actor, node=node):
        item = f"tier {action.tier} {action.run}/{action.step} part {action.part}"
        if action.outcome == PRUNED:
            report.retired.append(item)
        elif action.outcome in (FAILED, REFUSED):
            report.failed.append(f"{item}: {action.outcome}: {action.detail}")


def _adopt(settings: Settings, run: str, step: int, part: int, parts: int, *, steps: Steps, actor: str,
           attempt: str = "") -> None:
    """Register a part found only on Tier 1 from its manifest there, verify it in place."""
    reg = steps.register(settings, run, step, part, parts, actor=actor, source_tier=1, attempt=attempt)
    if reg.state == CKPT_SUPERSEDED:
        return  # recorded as history; never completed on a tier for resume
    steps.verify(settings, run, step, part, tier=1, actor=actor, attempt=attempt)
    steps.mark_complete(settings, run, step, 1, actor=actor, attempt=attempt)


def publish_report(settings: Settings, report: ReconcileReport, note: str = "") -> None:
    """The pass's report as its run's artifacts: every item (``reconcile-<node>``; ``note``, what
    its run says besides, in the description) and the promotions as a promote run shows them
    (``reconcile-promotions-<node>``)."""
    publish_table(artifact_key("reconcile", settings.node), report.rows(),
                  f"reconcile on {settings.node}" + (f": {note}" if note else ""))
    if report.promotions:  # in the UI, a checkpoint reconcile promoted reads as a promotion
        publish_table(artifact_key("reconcile-promotions", settings.node), report.promotions,
                      f"checkpoints reconcile promoted on {settings.node} (no event-driven run had)")


@flow(name="reconcile", flow_run_name="reconcile/{node}")
def reconcile(node: str | None = None) -> dict:
    """On demand (``ckpt reconcile``): settings read once here; the steps run as Prefect tasks;
    the report is an artifact."""
    settings = load_settings(**({"node": node} if node else {}))
    with artifact_batch(), announcing(emit):
        report = reconcile_once(settings, steps=task_steps(settings),
                                actor=current_actor(f"reconcile/{settings.node}"),
                                grace_seconds=settings.reconcile_interval_seconds,
                                on_durable=lambda result: publish_run_status(
                                    settings, result.run, durable_steps=(result.step,)))
        publish_report(settings, report)
    return {k: list(v) for k, v in vars(report).items()}


RESHOW_SECONDS = 3600.0  # the same failures again leave a run this long after the last that showed them


@dataclass(frozen=True)
class Shown:
    """What the last ``reconcile/<node>`` run of an agent's passes showed of their failures, kept by
    the agent between passes (each pass runs in a child of its own: handed in, handed back):
    which failures (a digest of the set, order ignored: a pass can fail on thousands of items),
    how many, since when the passes fail that way, and when a run last showed them."""

    digest: str = ""  # '' none
    count: int = 0
    since: float = 0.0  # time.time()
    at: float = 0.0


@dataclass(frozen=True)
class Verdict:
    run: bool  # the pass leaves its flow run
    note: str  # what that run says besides the report ('' nothing)
    shown: Shown  # what the agent keeps for the next pass


def failures_digest(failed: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(set(failed))).encode()).hexdigest() if failed else ""


def decide(failed: list[str], acted: bool, shown: Shown, *, now: float) -> Verdict:
    """Whether an agent's pass leaves a flow run (issue 40: housekeeping that found nothing leaves
    no run; a failure later repaired is shown as repaired). ``failed``: its failures; ``acted``:
    it did anything besides failing (promoted, marked missing, ...: always a run, as before).
    Failures the same as those the last run showed (order ignored) leave no new run, until an hour
    has passed since it (``RESHOW_SECONDS``: a failure that lasts stays on the Runs page); failures
    that changed leave one; failures gone leave one that says they cleared."""
    digest = failures_digest(failed)
    same = digest == shown.digest
    if same and not acted and (not failed or now - shown.at < RESHOW_SECONDS):
        return Verdict(False, "", shown)
    if failed and same:
        note = f"failing the same way since {_when(shown.since)}"
    elif not failed and shown.count:
        note = f"cleared: the {shown.count} failure(s) shown at {_when(shown.at)} no longer fail"
    else:
        note = ""
    kept = Shown(digest, len(set(failed)), shown.since if same else now, now) if failed else Shown()
    return Verdict(True, note, kept)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def reconcile_pass(settings: Settings, shown: Shown = Shown(), *,
                   events: bool = True, cluster: bool = True) -> tuple[ReconcileReport, Shown]:
    """One pass as a node's agent runs it (in a child of its own: deployments/reconcile_loop.py):
    plain code, no flow run, no task runs, each step under the task retry policy
    (``inline_steps``), the facts it announces sent to the event feed as a flow's are. A pass
    that raised (a catalog down, a tier unreachable) is one failure, ``the pass: ...``. Its
    flow run, ``reconcile/<node>`` (``reconciled``), only as ``decide`` says: a pass that acted,
    or whose failures differ from those ``shown`` by the last run; a pass that failed as the last
    run showed is one line of the log instead (its items' lines held back: ``_held_lines``).
    Its actor in the audit is ``reconcile/<node>``. A part the job committed less than an
    interval ago and the catalog has not registered is left to its completed event where this
    node's agent promotes on events (``events``; not ``ckpt reconcile --every``, where no agent
    listens). Without ``cluster`` (a node's agent) the cluster's share is left to the cluster
    agent's pass (``reconcile_once``). Returns the report and what to keep."""
    durable: set[tuple[str, int]] = set()
    crashed: BaseException | None = None
    with _held_lines() as held:
        try:
            with announcing(emit):
                report = reconcile_once(settings, steps=inline_steps(settings), actor=f"reconcile/{settings.node}",
                                        grace_seconds=settings.reconcile_interval_seconds,
                                        event_seconds=settings.reconcile_interval_seconds if events else 0.0,
                                        cluster=cluster,
                                        on_durable=lambda result: durable.add((result.run, result.step)))
        except Exception as exc:  # noqa: BLE001 - the next pass tries again; shown as any failure
            crashed = exc
            report = ReconcileReport(failed=[f"the pass: {type(exc).__name__}: {_first_line(exc)}"])
    verdict = decide(report.failed, replace(report, failed=[]).acted(), shown, now=time.time())
    if not verdict.run:
        if report.failed:
            log.warning("reconcile on %s: the same %d failure(s) as the run at %s showed (failing so since %s); "
                        "no new run until they change or clear: %s", settings.node, shown.count, _when(shown.at),
                        _when(shown.since), "; ".join(report.failed[:3]))
        return report, shown
    for record in held:
        log.handle(record)
    if crashed is not None:
        log.warning("reconcile on %s failed: %s: %s", settings.node, type(crashed).__name__, crashed,
                    exc_info=not isinstance(crashed, CkptError))
    if not get_current_settings().api.url:  # no Prefect API (`ckpt reconcile --every` alone): the log is the
        return report, verdict.shown  # record; a flow run here would start Prefect's temporary server
    try:
        reconciled(settings.node, json.dumps(vars(report)), sorted(durable), verdict.note, return_state=True)
    except Exception as exc:  # noqa: BLE001 - no run: the next pass shows it again
        log.warning("reconcile on %s: its flow run not recorded: %s: %s", settings.node, type(exc).__name__, exc)
        return report, shown
    return report, verdict.shown


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0]


@contextmanager
def _held_lines() -> Iterator[list[logging.LogRecord]]:
    """The pass's lines about its failing items (``tasks.reconcile.FAILURE``), held back for the
    block: logged after it only when its failures are news (``decide``)."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if getattr(record, FAILURE, False):
            held.append(record)
            return False
        return True

    log.addFilter(hold)
    try:
        yield held
    finally:
        log.removeFilter(hold)


@flow(name="reconcile", flow_run_name="reconcile/{node}")
def reconciled(node: str, report: str, durable: list[tuple[str, int]], note: str = "") -> Any:
    """The flow run of an agent's pass that acted, made after the pass (``reconcile_pass``): its
    report as artifacts, the status page of each training run it made ``durable`` (run, step)
    republished (a failed promote run of those checkpoints then reads repaired by
    ``reconcile/<node>`` there, and carries a note in its own Artifacts tab), the pass's report
    (``ReconcileReport`` as JSON: a flow's parameters are plain values) as its result. Failed,
    with the items in its message, when an item failed: red on the Runs page, as a failed
    promotion is."""
    from prefect.states import Completed, Failed

    settings = load_settings(node=node)
    done = ReconcileReport(**json.loads(report))
    with artifact_batch():
        publish_report(settings, done, note)
        for run in sorted({r for r, _ in durable}):
            publish_run_status(settings, run, durable_steps={step for r, step in durable if r == run})
    if done.failed:
        return Failed(message=f"{len(done.failed)} item(s) failed" + (f" ({note})" if note else "") + ": "
                      + "; ".join(done.failed[:5]))
    result = {k: list(v) for k, v in vars(done).items()}
    return Completed(message=note, data=result) if note else result
