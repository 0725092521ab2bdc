"""reconcile: make the catalog agree with what the tiers hold, and finish what events missed.

Runs every few minutes on each node (and on demand). In order:
0. claims whose worker died are recovered: a replica ``copying`` past its lease (a killed copy
   or verify) is re-checked against its files, as a verify does: ``verified`` when they read
   back whole, else ``missing`` (or ``corrupt``) so promotion acts again; one ``pruning`` past its lease is
   taken over by the guarded prune, which re-runs the whole guard and then finishes it or
   gives the copy back (Tier 0 only for this node's own NVMe);
1. replicas the catalog calls ``verified`` whose manifest or files vanished (Tier 0 of this
   node, Tier 1, Tier 2) become ``missing``: a bounded slice per tier per pass
   (``reconcile_check_limit``), in rotation, so a pass costs the same at any catalog size;
2. parts committed on this node's Tier 0 that the catalog does not know, or that were never
   (or no longer, after step 1) verified on Tier 1, are promoted;
3. parts committed on Tier 1 that the catalog does not know are registered from their Tier 1
   manifest, verified in place and recorded (a catalog restored from an older backup): a
   bounded share of Tier 1 per pass, run folder by run folder, in rotation;
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

import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from prefect import flow

from core.errors import BadInput, CkptError, CopyInProgress, CorruptCheckpoint, NotFound, PruneRefused
from core.events import announcing
from core.layout import checkpoint_prefix, part_key
from core.settings import Settings, load_settings
from core.storage.base import TierStore
from db.catalog import Catalog
from db.entities import (
    CKPT_CORRUPT,
    CKPT_REJECTED,
    CKPT_RETIRED,
    COPYING,
    CORRUPT,
    MISSING,
    PENDING,
    PRUNING,
    VERIFIED,
    CheckpointInfo,
    PromotionStatus,
    ReplicaInfo,
    StoredCopy,
)
from flows.archive import archive
from flows.common import Steps, artifact_batch, artifact_key, current_actor, publish_table, task_steps
from flows.promote import PromoteResult, follow_up, promote
from flows.status import publish_run_status
from tasks.base import log, open_catalog, open_tier
from tasks.prefect_events import emit
from tasks.record import claim_followups
from tasks.retention import FAILED, PRUNED, REFUSED, apply_retention, finish_retirements as _finish_retirements

ADOPT_CURSOR = "reconcile-adopt:tier1"


@dataclass
class ReconcileReport:
    recovered: list[str] = field(default_factory=list)  # stuck claims settled, with how
    missing: list[str] = field(default_factory=list)  # 'tier T run/step part P'
    promoted: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    followed_up: list[str] = field(default_factory=list)  # follow-ups a killed promotion left, finished
    archived: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)  # this node's Tier 0, by retention
    retired: list[str] = field(default_factory=list)  # copies of retired checkpoints deleted at last
    skipped: list[str] = field(default_factory=list)  # with why
    failed: list[str] = field(default_factory=list)  # with the error
    # what a promotion's own run shows, for each one this pass made: run, step, part, tiers
    promotions: list[dict[str, Any]] = field(default_factory=list)

    def rows(self) -> list[dict[str, str]]:
        return [{"action": k, "item": item} for k, items in vars(self).items() if k != "promotions"
                for item in items]


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
                   on_durable: Callable[[PromoteResult], None] | None = None) -> ReconcileReport:
    """One pass of the sweeps above on this node (``on_durable``: as for ``promote``)."""
    from core.transfer import find_committed

    report = ReconcileReport()
    recover_claims(settings, report, steps=steps, actor=actor)
    mark_missing(settings, report, actor=actor)
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, 0) as tier0, \
            open_tier(settings, 1) as tier1:
        todo0 = _todo(cat, tier0, list(find_committed(tier0)), report, tier=0, grace_seconds=grace_seconds)
        todo1 = _todo(cat, tier1, _adoption_slice(cat, tier1, settings.reconcile_check_limit), report, tier=1,
                      grace_seconds=grace_seconds)
    kw = dict(actor=actor)
    for run, step, part, parts in todo0:
        _attempt(report, report.promoted, f"{run}/{step} part {part}",
                 lambda: report.promotions.append(promotion_row(
                     promote(settings, run, step, part, parts, steps=steps, node=settings.node,
                             on_durable=on_durable, **kw))))
    for run, step, part, parts in todo1:
        _attempt(report, report.adopted, f"{run}/{step} part {part}",
                 lambda: _adopt(settings, run, step, part, parts, steps=steps, **kw))
    for ck in _followups_due(settings, report, grace_seconds=grace_seconds):
        _attempt(report, report.followed_up, f"{ck.run}/{ck.step}",
                 lambda ck=ck: _follow_up(settings, ck, steps=steps, actor=actor, on_durable=on_durable))
    for run, step in archive_backlog(settings):
        _attempt(report, report.archived, f"{run}/{step}",
                 lambda: archive(settings, run, step, steps=steps, **kw))
    prune_own_tier0(settings, report, steps=steps, **kw)
    finish_retirements(settings, report, steps=steps, **kw)
    return report


def recover_claims(settings: Settings, report: ReconcileReport, *, steps: Steps, actor: str) -> None:
    """Step 0: settle every claim whose lease lapsed (by the catalog's clock). Idempotent: a
    claim that was settled or renewed meanwhile is left alone."""
    with open_catalog(settings.catalog_url) as cat:
        stuck = cat.expired_claims()
        lapsed = [rep for rep in stuck if rep.state == COPYING
                  and _each(report, _item(rep), lambda rep=rep: cat.expire_copy_claim(rep.id, actor=actor))]
    for rep in lapsed:
        report.recovered.append(f"{_item(rep)}: stalled copy -> {_recheck(settings, rep, steps=steps, actor=actor)}")
    for rep in [r for r in stuck if r.state == PRUNING]:
        item = _item(rep)
        if (rep.tier == 0 and rep.node not in (None, "", settings.node)) or not settings.tier_url(rep.tier):
            continue  # another node's NVMe: its own reconcile takes it over
        try:
            steps.prune(settings, rep.id, actor=actor, reason="stalled prune taken over by reconcile")
            report.recovered.append(f"{item}: stalled prune finished")
        except PruneRefused as exc:
            report.recovered.append(f"{item}: stalled prune given up: {exc}")
        except Exception as exc:  # noqa: BLE001 - one failing item never stops the pass
            log.warning("reconcile: stalled prune of %s: %s", item, exc, exc_info=not isinstance(exc, CkptError))
            report.failed.append(f"{item}: {type(exc).__name__}: {exc}")


def _followups_due(settings: Settings, report: ReconcileReport, *, grace_seconds: float) -> list[CheckpointInfo]:
    """Checkpoints complete on Tier 1 whose follow-ups no caller finished (one index read)."""
    with open_catalog(settings.catalog_url) as cat:
        return _each(report, "follow-ups backlog", lambda: cat.followups_due(
            1, older_than_seconds=grace_seconds, limit=settings.reconcile_check_limit)) or []


def _follow_up(settings: Settings, ck: CheckpointInfo, *, steps: Steps, actor: str,
               on_durable: Callable[[PromoteResult], None] | None) -> None:
    """Step 3b: run the follow-ups of a checkpoint complete on Tier 1 that nobody finished (its
    promotion was killed after recording the completion), under their lease."""
    if not claim_followups(settings, ck.id):
        raise CopyInProgress(f"follow-ups of {ck.run}/{ck.step} taken by another caller meanwhile")
    follow_up(settings, PromoteResult(ck.run, ck.step, 0, ck.parts, ck.id), steps=steps, node=settings.node,
              actor=actor, on_durable=on_durable)


def _item(rep: ReplicaInfo) -> str:
    return f"tier {rep.tier} {rep.run}/{rep.step} part {rep.part}"


def _recheck(settings: Settings, rep: ReplicaInfo, *, steps: Steps, actor: str) -> str:
    """The state of a replica whose copy or verify claim lapsed, by its files: a killed verify
    of an intact copy leaves a copy that is still there (and on Tier 0 would hold the node's
    disk for good if it stayed ``missing``: retention prunes only verified copies), so it is
    read back against its manifest like any verify; ``missing`` when it cannot be read here
    (another node's NVMe: that node's reconcile re-checks it) or is not whole."""
    if (rep.tier == 0 and rep.node not in (None, "", settings.node)) or not settings.tier_url(rep.tier):
        return "missing (re-checked by the node that holds it)"
    try:
        steps.verify(settings, rep.run, rep.step, rep.part, tier=rep.tier, node=rep.node or None, actor=actor)
        return "verified (its files read back against the manifest)"
    except CorruptCheckpoint as exc:
        return f"corrupt ({exc})"
    except NotFound as exc:
        return f"missing ({exc})"
    except CkptError as exc:  # could not be read now: missing, and the next promotion or pass acts on it
        log.warning("reconcile: re-check of %s failed: %s", _item(rep), exc)
        return f"missing (re-check failed: {type(exc).__name__}: {exc})"


def prune_own_tier0(settings: Settings, report: ReconcileReport, *, steps: Steps, actor: str) -> None:
    """Apply Tier 0 retention to the replicas on this node's NVMe (step 5)."""
    if not settings.retention(0).enabled:
        return
    plan = steps.plan_retention(settings, tiers=(0,), node=settings.node)
    for action in apply_retention(settings, plan, prune=steps.prune, actor=actor):
        item = f"tier 0 {action.run}/{action.step} part {action.part}"
        if action.outcome == PRUNED:
            report.pruned.append(item)
        elif action.outcome == FAILED:
            report.failed.append(f"{item}: {action.detail}")


def finish_retirements(settings: Settings, report: ReconcileReport, *, steps: Steps, actor: str) -> None:
    """Delete what interrupted retirements left (step 6): every copy of a retired checkpoint,
    on Tier 1 and 2 and on this node's Tier 0 (another node's NVMe is its own reconcile's)."""
    for action in _finish_retirements(settings, prune=steps.prune, actor=actor):
        item = f"tier {action.tier} {action.run}/{action.step} part {action.part}"
        if action.outcome == PRUNED:
            report.retired.append(item)
        elif action.outcome in (FAILED, REFUSED):
            report.failed.append(f"{item}: {action.outcome}: {action.detail}")


def _attempt(report: ReconcileReport, done: list[str], item: str, fn: Any) -> None:
    try:
        fn()
        done.append(item)
    except CopyInProgress as exc:
        report.skipped.append(f"{item}: {exc}")
    except Exception as exc:  # noqa: BLE001 - one failing item never stops the pass
        log.warning("reconcile: %s failed: %s", item, exc, exc_info=not isinstance(exc, CkptError))
        report.failed.append(f"{item}: {type(exc).__name__}: {exc}")


def _todo(cat: Catalog, store: TierStore, found: list[tuple[str, int, int, int]], report: ReconcileReport, *,
          tier: int, grace_seconds: float) -> list[tuple[str, int, int, int]]:
    """The parts committed on ``store`` that need promoting (Tier 0) or adopting (Tier 1): the
    catalog's view of all of them in one set-based read (``promotion_status``), not queries per
    part; a part's manifest is read only for the few that look wanted (``_rejected``). A part
    named out of range (``check_ref``) is listed and left alone; should the set-based read fail,
    each part is read on its own, so one bad item fails only itself."""
    found = [p for p in found if _named_in_range(p, report, tier=tier)]
    status = _promotion_status(cat, found, report, tier=tier, grace_seconds=grace_seconds)
    todo = []
    for p in found:
        if p[:2] not in status:
            continue  # its read failed: listed by ``_promotion_status``
        if _each(report, f"tier {tier} {p[0]}/{p[1]} part {p[2]}",
                 lambda p=p: _wanted(status[p[:2]], p, report, tier=tier)
                 and not _rejected(cat, store, p, report, tier=tier)):
            todo.append(p)
    return todo


def _named_in_range(found: tuple[str, int, int, int], report: ReconcileReport, *, tier: int) -> bool:
    from core.layout import check_ref

    run, step, part, parts = found
    try:
        check_ref(step, part, parts)
        return True
    except BadInput as exc:
        report.skipped.append(f"tier {tier} {checkpoint_prefix(run, step)} part {part}: {exc}; folder left alone")
        return False


def _promotion_status(cat: Catalog, found: list[tuple[str, int, int, int]], report: ReconcileReport, *, tier: int,
                      grace_seconds: float) -> dict[tuple[str, int], PromotionStatus | None]:
    """(run, step) -> its status (None: unknown to the catalog) for every pair whose read worked."""
    pairs = sorted({(p[0], p[1]) for p in found})
    try:
        got = cat.promotion_status(pairs, older_than_seconds=grace_seconds)
        return {pair: got.get(pair) for pair in pairs}
    except Exception as exc:  # noqa: BLE001 - one bad pair must not stop the pass: isolate it below
        log.warning("reconcile: promotion status of %d checkpoints failed (%s); reading them one by one",
                    len(pairs), exc)
    out: dict[tuple[str, int], PromotionStatus | None] = {}
    for pair in pairs:
        _each(report, f"tier {tier} {pair[0]}/{pair[1]}", lambda pair=pair: out.__setitem__(
            pair, cat.promotion_status([pair], older_than_seconds=grace_seconds).get(pair)))
    return out


def _each(report: ReconcileReport, item: str, fn: Any) -> Any:
    """``fn()``, or None with the failure listed: any error of one item stays that item's."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the pass goes on; the error is reported and logged
        log.warning("reconcile: %s failed: %s", item, exc, exc_info=not isinstance(exc, CkptError))
        report.failed.append(f"{item}: {type(exc).__name__}: {exc}")
        return None


def _adoption_slice(cat: Catalog, tier1: TierStore, limit: int) -> list[tuple[str, int, int, int]]:
    """Parts committed on Tier 1, run folder by run folder from where the last pass (of any
    node: one shared ``sweep_cursor``) stopped, until about ``limit`` parts are found (at least
    one run per pass); past the last run the next pass starts again at the first. A pass lists
    a bounded share of Tier 1, not all of it; a run folder added or removed meanwhile shifts the
    rotation by one, which at worst checks a run twice or leaves it to the next rotation."""
    from core.transfer import find_committed

    runs = tier1.folders()
    i = cat.sweep_cursor(ADOPT_CURSOR)
    i = i if i < len(runs) else 0
    found: list[tuple[str, int, int, int]] = []
    while i < len(runs) and len(found) < limit:
        found += find_committed(tier1, runs[i])
        i += 1
    cat.set_sweep_cursor(ADOPT_CURSOR, i if i < len(runs) else 0)
    return found


def _wanted(ck: PromotionStatus | None, found: tuple[str, int, int, int], report: ReconcileReport, *,
            tier: int) -> bool:
    """Whether a part committed on ``tier`` needs promoting (Tier 0) or adopting (Tier 1)."""
    run, step, part, _parts = found
    if ck is None:  # an unknown checkpoint or run: registering the part creates it
        return True
    if ck.state in (CKPT_CORRUPT, CKPT_RETIRED):
        report.skipped.append(f"tier {tier} {run}/{step} part {part}: checkpoint is {ck.state}")
        return False
    if ck.state == CKPT_REJECTED:
        return True  # ``_rejected`` tells a refused manifest from a re-save
    if part not in ck.registered:
        return True  # this part was never registered
    state = ck.tier1.get(part)
    if tier == 1:
        return state is None
    if state in (MISSING, CORRUPT):
        return True  # a broken Tier 1 copy: copy it again from here
    # never copied, or a copy that stalled: only once past the grace period (``stale``), so the
    # event-triggered promotion running right now is not raced for nothing
    return state in (None, PENDING, COPYING) and ck.stale


def _rejected(cat: Catalog, store: TierStore, found: tuple[str, int, int, int], report: ReconcileReport, *,
              tier: int) -> bool:
    """Whether the part's manifest on ``store`` is one the catalog already refused (skipped,
    listed, not judged again); a re-saved part has another digest and is promoted afresh."""
    from core.manifest_build import read_attempt_digest

    run, step, part, parts = found
    prior = cat.rejection(run, step, part, read_attempt_digest(store, checkpoint_prefix(run, step), part, parts))
    if prior is not None:
        report.skipped.append(f"tier {tier} {run}/{step} part {part}: rejected: {prior.reason}")
    return prior is not None


def _adopt(settings: Settings, run: str, step: int, part: int, parts: int, *, steps: Steps, actor: str) -> None:
    """Register a part found only on Tier 1 from its manifest there, verify it in place."""
    steps.register(settings, run, step, part, parts, actor=actor, source_tier=1)
    steps.verify(settings, run, step, part, tier=1, actor=actor)
    steps.mark_complete(settings, run, step, 1, actor=actor)


def mark_missing(settings: Settings, report: ReconcileReport, *, actor: str) -> None:
    """Verified replicas whose manifest or any file is gone from their tier become ``missing``."""
    with ExitStack() as stack:
        stores = {t: stack.enter_context(open_tier(settings, t)) for t in (0, 1, 2) if settings.tier_url(t)}
        _mark_missing(settings, stores, report, actor=actor)


def _mark_missing(settings: Settings, stores: dict[int, Any], report: ReconcileReport, *, actor: str) -> None:
    """Check the next ``reconcile_check_limit`` verified copies of each tier (Tier 0: this
    node's) against the tier: one page query and one listing per copy, whatever the catalog
    holds. Where the page stopped is kept in the catalog (``sweep_cursor``: one per node for
    Tier 0, one shared by every node for Tiers 1 and 2), so the next pass, on any node, goes on
    from there and every copy is checked in rotation; a page shorter than the limit wraps."""
    limit = settings.reconcile_check_limit
    with open_catalog(settings.catalog_url) as cat:
        for tier, store in stores.items():
            cursor = f"reconcile-vanished:tier{tier}" + (f":{settings.node}" if tier == 0 else "")
            page = cat.verified_page(tier, after_id=cat.sweep_cursor(cursor), limit=limit,
                                     node=settings.node if tier == 0 else None)
            for copy in page:
                rep = copy.replica
                _each(report, f"tier {rep.tier} {rep.run}/{rep.step} part {rep.part}",
                      lambda copy=copy, store=store: _mark_if_vanished(cat, store, copy, report, actor=actor))
            cat.set_sweep_cursor(cursor, page[-1].replica.id if len(page) == limit else 0)


def _mark_if_vanished(cat: Catalog, store: Any, copy: StoredCopy, report: ReconcileReport, *, actor: str) -> None:
    rep = copy.replica
    gone = _vanished(store, copy)
    if gone is None:
        return
    try:
        cat.transition(rep.id, MISSING, expected=VERIFIED, actor=actor, reason=gone)
        report.missing.append(f"tier {rep.tier} {rep.run}/{rep.step} part {rep.part}: {gone}")
    except CkptError as exc:  # changed meanwhile (pruned, re-verified): nothing to do
        log.info("reconcile: replica %s not marked missing: %s", rep.id, exc)


def _vanished(store: Any, copy: StoredCopy) -> str | None:
    """What is gone of a part on ``store`` (None when its manifest and every file are there)."""
    rep = copy.replica
    prefix = checkpoint_prefix(rep.run, rep.step)
    present = {o.key: o.size for o in store.list(prefix)}
    if part_key(rep.run, rep.step, rep.part, copy.parts) not in present:
        return "manifest vanished"
    for f in copy.files:
        size = present.get(f"{prefix}/{f.path}")
        if size is None:
            return f"{f.path} vanished"
        if size != f.size:
            return f"{f.path} has {size} bytes, expected {f.size}"
    return None


def archive_backlog(settings: Settings) -> list[tuple[str, int]]:
    """Milestones with a complete verified copy on Tier 1 but none on Tier 2 (one query)."""
    if not settings.tier2_url:
        return []
    with open_catalog(settings.catalog_url) as cat:
        return [(ck.run, ck.step) for ck in cat.milestone_backlog(settings.milestones)]


@flow(name="reconcile", flow_run_name="reconcile/{node}")
def reconcile(node: str | None = None) -> dict:
    """Settings read once here; the steps run as Prefect tasks; the report is an artifact."""
    settings = load_settings(**({"node": node} if node else {}))
    with artifact_batch(), announcing(emit):
        report = reconcile_once(settings, steps=task_steps(settings),
                                actor=current_actor(f"reconcile/{settings.node}"),
                                grace_seconds=settings.reconcile_interval_seconds,
                                on_durable=lambda result: publish_run_status(str(settings.catalog_url), result.run))
        publish_table(artifact_key("reconcile", settings.node), report.rows(), f"reconcile on {settings.node}")
        if report.promotions:  # in the UI, a checkpoint reconcile promoted reads as a promotion
            publish_table(artifact_key("reconcile-promotions", settings.node), report.promotions,
                          f"checkpoints reconcile promoted on {settings.node} (no event-driven run had)")
    return {k: list(v) for k, v in vars(report).items()}
