"""scrub: read stored copies back, mark what rotted, repair it from a good copy.

Contract of ``scrub``:
- It re-reads (every byte, plus the format check; ``core.transfer.verify_part(deep=True)``)
  a share of the verified replicas on the durable tiers (1 and 2; Tier 0 is scratch that the
  next restore or promotion checks anyway): ``fraction`` of them per run, least recently
  checked first, so that every copy is read within ``ceil(1 / fraction)`` runs. ``fraction=1``
  (``ckpt scrub --all``) reads them all.
- A copy that fails becomes ``corrupt`` (bytes, format or manifest differ from the catalog's
  record) or ``missing`` (its manifest is gone). A transient failure changes nothing.
- Repairs: every ``corrupt``/``missing`` replica on a durable tier, found now or earlier, is
  copied again from a verified replica readable here, or from one under a prune claim when no
  verified one is (reading deletes nothing; under a catalog claim, so a repair never
  races a promotion: the claim's holder removes the bad part, copies, reads back, and only then
  is the replica ``verified``); every checkpoint without a durable verified copy
  (``Catalog.under_replicated``, committed more than ``grace_seconds`` ago: younger ones are
  still being promoted) gets a Tier 1 copy from whatever verified copy is left. A replica
  another worker holds a live claim on is skipped, not failed.
- When each replica was last read back is the catalog's ``replicas.checked_at`` (stamped when
  it becomes verified and by ``Catalog.mark_checked`` after a clean read here); the share to
  read is ``Catalog.scrub_candidates``: one ordered query, not one per checkpoint, and the
  same cycle whichever machine runs the scrub.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from core import transfer
from core.errors import CkptError, is_transient
from core.layout import checkpoint_prefix
from core.settings import Settings
from core.tiers import DURABLE_TIERS, Tier
from db.catalog import Catalog
from db.entities import CKPT_RETIRED, COPYING, PENDING, PRUNING, VERIFIED, CheckpointInfo, ReplicaInfo
from tasks.base import delete_part, log, open_catalog, registered_manifest
from tasks.claim import ClaimedCopy
from tasks.replicas import BadReplica, TierStores, classify_failure, mark_bad, verified_sources
from tasks.retry import pipeline_task

REPAIR_PREFERENCE = (1, 2, 0)  # read repairs from the shared tiers first, this node's NVMe last
DEFAULT_GRACE_S = 600.0  # a checkpoint committed this recently is still being promoted


@dataclass
class Repair:
    run: str
    step: int
    part: int
    tier: int
    source_tier: int | None
    ok: bool
    detail: str

    def row(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "part": self.part, "tier": self.tier,
                "from tier": self.source_tier, "ok": self.ok, "detail": self.detail}


@dataclass
class ScrubReport:
    eligible: int  # verified durable replicas readable here
    checked: int  # re-read by this run
    bytes_read: int
    seconds: float
    checked_ids: list[int] = field(default_factory=list)  # replica ids read back in full
    bad: list[BadReplica] = field(default_factory=list)
    repairs: list[Repair] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # transient failures, lost claims

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.repairs)

    def summary(self) -> str:
        fixed = sum(r.ok for r in self.repairs)
        return (f"scrub: read {self.checked} of {self.eligible} verified copies "
                f"({self.bytes_read / 1e6:.1f} MB in {self.seconds:.1f} s), {len(self.bad)} bad, "
                f"{fixed} repaired, {len(self.repairs) - fixed} not repairable")


def scrub(settings: Settings, *, fraction: float | None = None, repair: bool = True, actor: str = "cli",
          grace_seconds: float = DEFAULT_GRACE_S, now: datetime | None = None) -> ScrubReport:
    """Re-read a share of the stored copies, mark failures, repair; see the module contract."""
    fraction = settings.scrub_fraction if fraction is None else fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    started = time.monotonic()
    tiers = [t for t in DURABLE_TIERS if settings.tier_url(t)]  # Tiers 1 and 2 are readable wherever configured
    with open_catalog(settings.catalog_url) as cat, TierStores(settings) as stores:
        now = now or cat.clock()  # the grace runs on the clock that stamped the commits, not this worker's
        eligible = cat.count_verified(tiers)
        chosen = cat.scrub_candidates(tiers, math.ceil(fraction * eligible)) if eligible else []
        report = ScrubReport(eligible=eligible, checked=0, bytes_read=0, seconds=0.0)
        checkpoints: dict[int, CheckpointInfo] = {}
        for rep in chosen:
            ck = checkpoints.get(rep.checkpoint_id) or cat.get_checkpoint_by_id(rep.checkpoint_id)
            checkpoints[ck.id] = ck
            nbytes = _reread(cat, stores, ck, rep, report, actor)
            if nbytes is not None:
                report.checked += 1
                report.checked_ids.append(rep.id)
                report.bytes_read += nbytes
                cat.mark_checked(rep.id, actor=actor)  # a copy just marked bad is left as it is
        if repair:
            _repair_bad(cat, stores, report, actor)
            _repair_under_replicated(cat, stores, report, actor,
                                     committed_before=now - timedelta(seconds=grace_seconds))
    report.seconds = time.monotonic() - started
    log.info("%s", report.summary())
    return report


def _reread(cat: Catalog, stores: TierStores, ck: CheckpointInfo, rep: ReplicaInfo, report: ScrubReport,
            actor: str) -> int | None:
    """Read one replica back in full; mark it bad on a proven failure. Bytes read, or None
    when the read could not finish for a transient reason."""
    settings = stores.settings
    store = stores.get(rep.tier)
    try:
        manifest = registered_manifest(cat, store, ck.id, ck.run, ck.step, rep.part, ck.parts, attempt=ck.attempt)
        transfer.verify_part(store, checkpoint_prefix(ck.run, ck.step, ck.attempt), manifest,
                             parallelism=settings.copy_parallelism, buffer_bytes=settings.io_buffer_bytes, deep=True)
        return manifest.total_bytes
    except Exception as exc:  # classified below; the rest propagates
        state = classify_failure(exc)
        if state is None:
            if not is_transient(exc):
                raise
            report.skipped.append(f"{ck.run}/step-{ck.step} part {rep.part} tier {rep.tier}: {exc}")
            return None
        log.warning("scrub: %s/step-%d part %d on tier %d is %s: %s", ck.run, ck.step, rep.part, rep.tier, state, exc)
        report.bad.append(mark_bad(cat, rep, state, f"scrub: {exc}", actor=actor))
        return 0


def _repair_bad(cat: Catalog, stores: TierStores, report: ScrubReport, actor: str) -> None:
    """Copy again every corrupt/missing durable replica that has a good copy elsewhere."""
    for bad in cat.bad_replicas([t for t in DURABLE_TIERS if stores.configured(t)]):
        ck, reps = cat.get_checkpoint_by_id(bad.checkpoint_id), cat.replicas(bad.checkpoint_id)
        _note(report, repair_replica(cat, stores, ck, bad.part, bad.tier, reps, actor))


def _repair_under_replicated(cat: Catalog, stores: TierStores, report: ScrubReport, actor: str, *,
                             committed_before: datetime) -> None:
    """Give every checkpoint without a durable verified copy a Tier 1 copy, part by part;
    checkpoints committed after ``committed_before`` are left to the promotion in flight."""
    for ck in cat.under_replicated(durable_tier=Tier.SHARED):
        if ck.committed_at is not None and ck.committed_at > committed_before:
            continue
        reps = cat.replicas(ck.id)
        for part in range(ck.parts):
            if any(r.part == part and r.state == VERIFIED and Tier(r.tier).durable for r in reps) or any(
                    (r.run, r.step, r.part) == (ck.run, ck.step, part) for r in report.repairs):
                continue  # durable, or already tried by this run
            own = [r for r in reps if r.part == part]
            if all(r.state in (PENDING, COPYING) for r in own):
                # never trusted anywhere yet: a promotion in flight (or one that died, which
                # reconcile takes over) makes it durable; scrub only copies from verified bytes
                _note(report, _left_to_promotion(ck, part, own))
                continue
            _note(report, repair_replica(cat, stores, ck, part, 1, reps, actor))


def _left_to_promotion(ck: CheckpointInfo, part: int, own: list[ReplicaInfo]) -> str:
    states = ", ".join(sorted({r.state for r in own})) or "no copy recorded"
    return (f"{ck.run}/step-{ck.step} part {part}: not verified on any tier yet ({states}): "
            "left to its promotion and reconcile")


def _never_verified(own: list[ReplicaInfo]) -> bool:
    """No copy of the part was ever verified: its copies were only ever claimed, and a claimed
    check or copy that failed for a transient reason (a storage outage) released them as
    ``missing`` with nothing trusted. Its bytes, if any, are its promotion's and reconcile's to
    bring in; there is no good copy to repair from, and none was lost."""
    return all(r.state != VERIFIED and r.verified_at is None for r in own)


def _note(report: ScrubReport, outcome: Repair | str) -> None:
    if isinstance(outcome, Repair):
        report.repairs.append(outcome)
    else:
        report.skipped.append(outcome)


def repair_replica(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int, tier: int,
                   replicas: list[ReplicaInfo], actor: str) -> Repair | str:
    """Make the replica of ``part`` on ``tier`` verified again from a good copy on another tier.

    As a claimed copy (``tasks.claim``): remove whatever the bad copy left (its manifest first,
    so it stops being committed; paths another live part lists stay), copy from the nearest
    verified replica readable here, read back, then ``verified``. Never raises for a repair
    that cannot be done; says why instead (a string when another worker holds the replica:
    nothing failed, it is being copied now).
    """
    if ck.state == CKPT_RETIRED:  # its copies are going: never copied back
        return f"{ck.run}/step-{ck.step} part {part} tier {tier}: checkpoint is retired, not repaired"
    own = [r for r in replicas if r.part == part]
    if _never_verified(own):
        return _left_to_promotion(ck, part, own)
    settings = stores.settings
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    found = _good_source(cat, stores, ck, part, tier, replicas, actor)
    if found is None:
        return Repair(ck.run, ck.step, part, tier, None, False, "no other verified copy is readable here")
    src_rep, manifest = found
    dst = stores.get(tier)
    held, rep = ClaimedCopy.take(cat, ck.id, tier, part, dst.url_for(prefix), node=None, actor=actor,
                                 what="scrub repair", lease_s=settings.claim_lease_seconds,
                                 stall_s=settings.copy_stall_seconds)
    if held is None:
        return (f"{ck.run}/step-{ck.step} part {part} tier {tier}: {rep.state} by another worker, "
                "not repaired here")
    started = time.monotonic()
    try:
        with held:
            bad = next((r.state for r in replicas if r.tier == tier and r.part == part), "absent")
            delete_part(cat, dst, ck.run, ck.step, part, ck.parts, actor=actor, token=held.token,  # manifest first
                        check=held.check, attempt=ck.attempt,
                        reason=f"scrub repair: replacing a {bad} copy from tier {src_rep.tier}")
            result = transfer.copy_part(stores.get(src_rep.tier), prefix, dst, prefix, manifest,
                                        parallelism=settings.copy_parallelism,
                                        progress=held.progress())
            held.verified(bytes=result.bytes, seconds=time.monotonic() - started,
                          reason=f"scrub repair from tier {src_rep.tier}")
    except CkptError as exc:
        return Repair(ck.run, ck.step, part, tier, src_rep.tier, False, f"repair failed: {exc}")
    log.info("scrub: repaired %s/step-%d part %d on tier %d from tier %d", ck.run, ck.step, part, tier, src_rep.tier)
    return Repair(ck.run, ck.step, part, tier, src_rep.tier, True, f"copied again from tier {src_rep.tier}")


def _good_source(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int, tier: int,
                 replicas: list[ReplicaInfo], actor: str) -> tuple[ReplicaInfo, Any] | None:
    """The nearest other verified replica whose committed manifest matches the catalog, with
    that manifest; a source found gone or altered is marked so on the way. Failing those, a
    copy under a prune claim (``pruning``, a live lease included: reading deletes nothing, and
    what is copied from it is read back against the catalog's manifest at the destination
    before it counts); one whose prune already removed bytes fails the copy, never marked."""
    settings = stores.settings
    sources = (verified_sources(replicas, part, settings, REPAIR_PREFERENCE)
               + verified_sources(replicas, part, settings, REPAIR_PREFERENCE, states=(PRUNING,)))
    for rep in sources:
        if rep.tier == tier:
            continue
        try:
            return rep, registered_manifest(cat, stores.get(rep.tier), ck.id, ck.run, ck.step, part, ck.parts,
                                            attempt=ck.attempt)
        except Exception as exc:  # classified below; the rest propagates
            state = classify_failure(exc)
            if state is None and not is_transient(exc):
                raise
            if state is not None:
                mark_bad(cat, rep, state, f"scrub repair source: {exc}", actor=actor)
    return None


scrub_task = pipeline_task(scrub, name="scrub", retries=2)
