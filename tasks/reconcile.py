"""The work of reconcile's sweeps (``flows.reconcile`` composes them): what the tiers hold that
the catalog does not know or calls wrongly, read in bounded, set-based slices, each item's failure
kept to itself and listed in the report.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from core.errors import BadInput, CkptError, CopyInProgress
from core.layout import check_ref, checkpoint_prefix, part_key
from core.manifest_build import read_attempt_digest
from core.paths import safe_run_name
from core.settings import Settings
from core.sizing import fmt_bytes
from core.storage.base import TierStore
from core.tiers import Tier
from core.transfer import find_committed
from db.catalog import Catalog
from db.entities import (
    CKPT_CORRUPT,
    CKPT_REJECTED,
    CKPT_RETIRED,
    CKPT_SUPERSEDED,
    COPYING,
    CORRUPT,
    MISSING,
    PENDING,
    VERIFIED,
    CheckpointInfo,
    PromotionStatus,
    ReplicaInfo,
    StoredCopy,
)
from tasks.base import log, open_catalog, open_tier
from tasks.tier0_space import sweep_dead_staging

ADOPT_CURSOR = "reconcile-adopt:tier1"
FAILURE = "ckpt_reconcile_failure"  # set on a log line about an item that failed (``flows.reconcile._held_lines``)


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

    def acted(self) -> bool:
        """Whether the pass changed or found wrong anything a person would look for: a copy
        promoted, adopted, archived, pruned, retired, marked missing, a claim recovered, or an item
        that failed. ``skipped`` alone (taken by another caller, a bad checkpoint left alone) is not:
        it repeats on every pass."""
        return any(items for k, items in vars(self).items() if k not in ("skipped", "promotions"))

    def rows(self) -> list[dict[str, str]]:
        return [{"action": k, "item": item} for k, items in vars(self).items() if k != "promotions"
                for item in items]


def followups_backlog(settings: Settings, report: ReconcileReport, *, grace_seconds: float) -> list[CheckpointInfo]:
    """Checkpoints complete on Tier 1 whose follow-ups no caller finished (one index read)."""
    with open_catalog(settings.catalog_url) as cat:
        return each(report, "follow-ups backlog", lambda: cat.followups_due(
            1, older_than_seconds=grace_seconds, limit=settings.reconcile_check_limit)) or []


def young_parts(committed: Iterable[tuple[tuple[str, int, int, int, str], float | None]], grace_seconds: float, *,
                now: float | None = None) -> set[tuple[str, int, int, str]]:
    """(run, step, part, attempt) of the parts in ``committed`` (``core.transfer.committed_at``)
    written less than ``grace_seconds`` ago. A time in the future (a clock set back) or unknown
    is not young: the grace only ever delays reconcile, never holds a part from it."""
    now = time.time() if now is None else now
    return {(run, step, part, attempt) for (run, step, part, _parts, attempt), at in committed
            if at is not None and 0 <= now - at < grace_seconds}


def replica_item(rep: ReplicaInfo) -> str:
    return f"tier {rep.tier} {rep.run}/{rep.step} part {rep.part}"


def attempt(report: ReconcileReport, done: list[str], item: str, fn: Any) -> None:
    try:
        fn()
        done.append(item)
    except CopyInProgress as exc:
        report.skipped.append(f"{item}: {exc}")
    except Exception as exc:  # noqa: BLE001 - one failing item never stops the pass
        log.warning("reconcile: %s failed: %s", item, exc, exc_info=not isinstance(exc, CkptError),
                    extra={FAILURE: True})
        report.failed.append(f"{item}: {type(exc).__name__}: {exc}")


def parts_todo(cat: Catalog, store: TierStore, found: list[tuple[str, int, int, int, str]], report: ReconcileReport, *,
          tier: int, grace_seconds: float, actor: str = "cli",
          young: Collection[tuple[str, int, int, str]] = ()) -> list[tuple[str, int, int, int, str]]:
    """The parts committed on ``store`` that need promoting (Tier 0) or adopting (Tier 1): the
    catalog's view of all of them in one set-based read (``promotion_status``), not queries per
    part; a part's manifest is read only for the few that look wanted (``_rejected``). A part
    named out of range (``check_ref``) is listed and left alone; should the set-based read fail,
    each part is read on its own, so one bad item fails only itself. A ``young`` part (run, step,
    part, attempt: committed within the grace, ``young_parts``) that the catalog has not
    registered yet is its event's: the agent is promoting it now, and the checkpoint's one
    promote run carries its follow-ups."""
    found = [p for p in found if _named_in_range(cat, store, p, report, tier=tier, actor=actor)]
    status = _promotion_status(cat, found, report, tier=tier, grace_seconds=grace_seconds)
    todo = []
    for p in found:
        if _key(p) not in status:
            continue  # its read failed: listed by ``_promotion_status``
        if each(report, f"tier {tier} {p[0]}/{p[1]} part {p[2]}",
                 lambda p=p: _wanted(status[_key(p)], p, report, tier=tier, young=(p[0], p[1], p[2], p[4]) in young)
                 and not _rejected(cat, store, p, report, tier=tier)):
            todo.append(p)
    return todo


def _named_in_range(cat: Catalog, store: TierStore, found: tuple[str, int, int, int, str], report: ReconcileReport, *,
                    tier: int, actor: str) -> bool:
    """Whether the folder's step and part numbers are in range (``check_ref``); one that is not is
    listed, audited as a rejection once (not on every pass) and left alone."""
    run, step, part, parts, attempt = found
    try:
        check_ref(step, part, parts)
        return True
    except BadInput as exc:
        what = f"tier {tier} {run}/step {step} part {part}"
        report.skipped.append(f"{what}: {exc}; folder left alone")
        subject = f"folder:{store.url_for(safe_run_name(run))}/step-{step}@{attempt}#part-{part}"
        reason = f"{type(exc).__name__}: {exc}"
        each(report, what, lambda: cat.record_rejection_once(subject, reason, actor=actor, run=run))
        return False


def _promotion_status(cat: Catalog, found: list[tuple[str, int, int, int, str]], report: ReconcileReport, *, tier: int,
                      grace_seconds: float) -> dict[tuple[str, int, str], PromotionStatus | None]:
    """(run, step, attempt) -> its status (None: unknown to the catalog) for every checkpoint whose
    read worked."""
    pairs = sorted({_key(p) for p in found})
    try:
        got = cat.promotion_status(pairs, older_than_seconds=grace_seconds)
        return {pair: got.get(pair) for pair in pairs}
    except Exception as exc:  # noqa: BLE001 - one bad pair must not stop the pass: isolate it below
        log.warning("reconcile: promotion status of %d checkpoints failed (%s); reading them one by one",
                    len(pairs), exc)
    out: dict[tuple[str, int, str], PromotionStatus | None] = {}
    for pair in pairs:
        each(report, f"tier {tier} {pair[0]}/{pair[1]}", lambda pair=pair: out.__setitem__(
            pair, cat.promotion_status([pair], older_than_seconds=grace_seconds).get(pair)))
    return out


def _key(found: tuple[str, int, int, int, str]) -> tuple[str, int, str]:
    return found[0], found[1], found[4]


def each(report: ReconcileReport, item: str, fn: Any) -> Any:
    """``fn()``, or None with the failure listed: any error of one item stays that item's."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the pass goes on; the error is reported and logged
        log.warning("reconcile: %s failed: %s", item, exc, exc_info=not isinstance(exc, CkptError),
                    extra={FAILURE: True})
        report.failed.append(f"{item}: {type(exc).__name__}: {exc}")
        return None


def adoption_slice(cat: Catalog, tier1: TierStore, limit: int,
                   visited: list[str] | None = None) -> list[tuple[str, int, int, int, str]]:
    """Parts committed on Tier 1, run folder by run folder from where the last pass (of any
    node: one shared ``sweep_cursor``) stopped, until about ``limit`` parts are found (at least
    one run per pass); past the last run the next pass starts again at the first. A pass lists
    a bounded share of Tier 1, not all of it; a run folder added or removed meanwhile shifts the
    rotation by one, which at worst checks a run twice or leaves it to the next rotation.
    ``visited`` receives the run folders this pass listed."""
    runs = tier1.folders()
    i = cat.sweep_cursor(ADOPT_CURSOR)
    i = i if i < len(runs) else 0
    found: list[tuple[str, int, int, int, str]] = []
    while i < len(runs) and len(found) < limit:
        found += find_committed(tier1, runs[i])
        if visited is not None:
            visited.append(runs[i])
        i += 1
    cat.set_sweep_cursor(ADOPT_CURSOR, i if i < len(runs) else 0)
    return found


def _wanted(ck: PromotionStatus | None, found: tuple[str, int, int, int, str], report: ReconcileReport, *,
            tier: int, young: bool = False) -> bool:
    """Whether a part committed on ``tier`` needs promoting (Tier 0) or adopting (Tier 1)."""
    run, step, part, _parts, _attempt = found
    if young and (ck is None or part not in ck.registered):
        return False  # its event's promotion is under way (``parts_todo``)
    if ck is None:  # an unknown checkpoint or run: registering the part creates it
        return True
    if ck.state == CKPT_SUPERSEDED and part not in ck.registered:
        return True  # a late part of an older attempt: recorded (superseded), never promoted
    if ck.state in (CKPT_CORRUPT, CKPT_RETIRED, CKPT_SUPERSEDED):
        report.skipped.append(f"tier {tier} {run}/{step} part {part}: checkpoint is {ck.state}")
        return False
    if ck.state == CKPT_REJECTED:
        return True  # ``_rejected`` tells a refused manifest from a re-save
    if part not in ck.registered:
        return True  # this part was never registered
    state = ck.tier1.get(part)
    if Tier(tier).shared_fs:
        return state is None
    if state in (MISSING, CORRUPT):
        return True  # a broken Tier 1 copy: copy it again from here
    # never copied, or a copy that stalled: only once past the grace period (``stale``), so the
    # event-triggered promotion running right now is not raced for nothing
    return state in (None, PENDING, COPYING) and ck.stale


def _rejected(cat: Catalog, store: TierStore, found: tuple[str, int, int, int, str], report: ReconcileReport, *,
              tier: int) -> bool:
    """Whether the part's manifest on ``store`` is one the catalog already refused (skipped,
    listed, not judged again); a re-saved part has another digest and is promoted afresh."""
    run, step, part, parts, attempt = found
    prefix = checkpoint_prefix(run, step, attempt)
    prior = cat.rejection(run, step, part, read_attempt_digest(store, prefix, part, parts))
    if prior is not None:
        report.skipped.append(f"tier {tier} {run}/{step} part {part}: rejected: {prior.reason}")
    return prior is not None


def mark_missing(settings: Settings, report: ReconcileReport, *, actor: str, object_store: bool = True) -> None:
    """Verified replicas whose manifest or any file is gone from their tier become ``missing``
    (the object store's only with ``object_store``). A tier that cannot be opened (its root not
    proven: a missing mount, an unreachable store) is one failed item, and its copies are not
    judged; the other tiers are checked and the pass goes on."""
    with ExitStack() as stack:
        stores: dict[int, Any] = {}
        for t in Tier:
            if settings.tier_url(t) and (object_store or not t.object_store):
                store = each(report, f"tier {int(t)} (vanished copies)",
                             lambda t=t: stack.enter_context(open_tier(settings, t)))
                if store is not None:
                    stores[int(t)] = store
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
            cursor = f"reconcile-vanished:tier{tier}" + (f":{settings.node}" if Tier(tier).node_local else "")
            page = cat.verified_page(tier, after_id=cat.sweep_cursor(cursor), limit=limit,
                                     node=settings.node if Tier(tier).node_local else None)
            for copy in page:
                rep = copy.replica
                each(report, f"tier {rep.tier} {rep.run}/{rep.step} part {rep.part}",
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
    prefix = checkpoint_prefix(rep.run, rep.step, rep.attempt)
    present = {o.key: o.size for o in store.list(prefix)}
    if part_key(rep.run, rep.step, rep.part, copy.parts, rep.attempt) not in present:
        return "manifest vanished"
    for f in copy.files:
        size = present.get(f"{prefix}/{f.path}")
        if size is None:
            return f"{f.path} vanished"
        if size != f.size:
            return f"{f.path} has {size} bytes, expected {f.size}"
    return None


def sweep_writer_staging(settings: Settings, report: ReconcileReport, *, actor: str) -> None:
    """Remove the staging folders a dead writer left in this node's Tier 0 run folders (a save
    or fetch killed midway): without this, a save killed before its publish holds that room
    until a person finds it. Live writers' are left alone (``core.space.writer_stagings``)."""
    with open_tier(settings, 0) as tier0:
        root = tier0.in_place()
        if root is None:  # writers stage only in a folder
            return
        removed = each(report, "tier 0 staging", lambda: sweep_dead_staging(settings, root, actor=actor))
    if removed:
        report.recovered.append(f"tier 0: {len(removed)} staging folder(s) of dead writers "
                                f"({fmt_bytes(sum(st.bytes for st in removed))}) removed")


def archive_backlog(settings: Settings) -> list[tuple[str, int]]:
    """Milestones with a complete verified copy on Tier 1 but none on Tier 2 (one query)."""
    if not settings.tier2_url:
        return []
    with open_catalog(settings.catalog_url) as cat:
        return [(ck.run, ck.step) for ck in cat.milestone_backlog(settings.milestones)]
