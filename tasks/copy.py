"""copy_to_tier1 / upload_to_tier2: copy one part between tiers as a claimed copy.

The catalog's claim (``tasks.claim.ClaimedCopy``) makes the copy happen once however many
promotions race: the caller that acquires it copies; a caller that finds the replica
``verified`` returns a skipped hop; one that finds another live claim raises
``CopyInProgress`` (transient: a retry finds it done). ``core.transfer.copy_part`` stages,
reads back and publishes with the manifest last, so a replica becomes ``verified`` only
after its bytes were read back from the destination. A copy that fails publishes nothing and
leaves the replica ``missing`` (with the reason), which the next claim may take again; a copy
killed outright leaves a claim that lapses after one lease.

``promote_part`` (Tier 0 -> 1) reads Tier 0 once: the copy checks every source byte against the
manifest on its way (``copy_part(check_source=True)``) and that is the Tier 0 verify, recorded
on the Tier 0 replica under its own claim. A source mismatch retracts what the copy published
and marks Tier 0 corrupt as ``verify_replica`` would; a copy failing for a reason of its own
reads Tier 0 back alone, so the Tier 0 record ends as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Protocol, Self

from core import events, formats, transfer
from core.errors import CopyInProgress, CorruptCheckpoint, NotFound, PathEscape
from core.layout import checkpoint_prefix
from core.manifest import Manifest
from core.progress import reporter, uninterrupted
from core.settings import Settings
from core.space import Reading, free_bytes, headroom
from core.storage.base import TierStore
from core.tiers import Tier
from core.transfer import SourceMismatch
from db.catalog import Catalog
from db.entities import COPYING, CORRUPT, MISSING, VERIFIED, CheckpointInfo, ReplicaInfo
from tasks.base import (
    HopResult,
    catalog_manifest,
    copy_priority,
    delete_part,
    fenced_delete,
    log,
    open_catalog,
    open_tier,
    registered_manifest,
    shared_paths,
    sweep_staging,
)
from tasks.claim import ClaimedCopy
from tasks.verify import part_replica, record_bad


class Landing(Protocol):
    """Where a claimed copy lands before it is published whole: ``key``, the prefix the files
    are copied under; ``publish`` puts the complete part in place (run under the claim, after
    the copy read every file back). Leaving the context removes what did not get published."""

    key: str

    def publish(self, manifest: Manifest) -> None: ...


# (catalog, destination store, checkpoint, part, the held claim) -> the landing of this copy
Stager = Callable[[Catalog, TierStore, CheckpointInfo, int, ClaimedCopy], AbstractContextManager[Landing]]


def copy_between_tiers(settings: Settings, run: str, step: int, part: int = 0, *,
                       src_tier: int, dst_tier: int, node: str | None = None, actor: str = "cli",
                       attempt: str | None = None, stage: Stager | None = None) -> HopResult:
    """Copy a registered part from ``src_tier`` to ``dst_tier`` and record it ``verified``.
    ``stage``: land the part in a stage and publish it whole (a resume's fetch into a folder
    tier, ``tasks.resume.stages``) rather than file by file under the checkpoint's prefix."""
    return _claimed_copy(settings, run, step, part, src_tier=src_tier, dst_tier=dst_tier,
                         node=node or settings.node, actor=actor, attempt=attempt, stage=stage)[-1]


def clear_prior(cat: Catalog, dst: TierStore, ck: CheckpointInfo, part: int, manifest: Manifest,
                prior: ReplicaInfo | None, *, held: ClaimedCopy, src_tier: int, actor: str) -> None:
    """Under the part's claim, before copying it to ``dst`` again: what an earlier copy left.
    Known-bad bytes (``corrupt``) are deleted, never resumed on. A copy of this part that died
    (``copying``/``missing``) left staging data that is garbage: this part's own files are ours
    alone under the claim (swept now, not after a wall-clock wait); paths another part also
    lists may be that part's live copy (swept only once a lease old); other parts' files are
    never touched."""
    run, step, prefix = ck.run, ck.step, checkpoint_prefix(ck.run, ck.step, ck.attempt)
    if prior is not None and prior.state == CORRUPT:
        delete_part(cat, dst, run, step, part, ck.parts, actor=actor, token=held.token, check=held.check,
                    attempt=ck.attempt,
                    reason=f"replica {prior.id} is corrupt; recopying from tier {src_tier}")
    elif prior is not None and prior.state in (COPYING, MISSING):
        own = [f.path for f in manifest.files] + [manifest.name]
        shared = {f.path for f in cat.files(ck.id) if f.part != part}
        why = f"left by a copy that died (replica {prior.id} was {prior.state})"
        sweep_staging(cat, dst, run, step, older_than_s=0, actor=actor, reason=why, attempt=ck.attempt,
                      keys=[f"{prefix}/{p}" for p in own if p not in shared])
        sweep_staging(cat, dst, run, step, older_than_s=held.lease_s, actor=actor, reason=why, attempt=ck.attempt,
                      keys=[f"{prefix}/{p}" for p in own if p in shared])


def _claimed_copy(settings: Settings, run: str, step: int, part: int, *, src_tier: int, dst_tier: int,
                  node: str, actor: str, check_source: bool = False, attempt: str | None = None,
                  stage: Stager | None = None) -> list[HopResult]:
    """The copy under the destination's claim; with ``check_source`` (Tier 0 -> 1 only) also
    the verify of the Tier 0 source, from the same read (``promote_part``)."""
    hop = f"tier {src_tier} -> tier {dst_tier}"
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, src_tier) as src, \
            open_tier(settings, dst_tier) as dst, ThreadPoolExecutor(1, thread_name_prefix="manifest") as side:
        ck = cat.get_checkpoint(run, step, attempt)
        prefix = checkpoint_prefix(run, step, ck.attempt)
        url = dst.url_for(prefix)
        source_side = _Tier0Source(cat, ck, src, part, node, actor, settings) if check_source else nullcontext()
        with source_side as source:
            manifest, found = (source.manifest(), None) if source is not None else \
                _source_manifest(cat, src, ck, part, side)
            prior = part_replica(cat, ck.id, dst_tier, part, None)
            held, rep = ClaimedCopy.take(cat, ck.id, dst_tier, part, url,
                                         node=node if Tier(dst_tier).node_local else None, actor=actor,
                                         lease_s=settings.claim_lease_seconds, stall_s=settings.copy_stall_seconds)
            if held is None:
                if found is not None:
                    found.cancel()
                if source is not None:  # no copy to read it: Tier 0 is checked alone
                    source.verify_alone(settings)
                if rep.state == VERIFIED:
                    done = HopResult(hop=hop, run=run, step=step, part=part, files=len(manifest.files),
                                     bytes=manifest.total_bytes, seconds=0.0, skipped=True)
                    return [done] if source is None else [source.hop(), done]
                raise CopyInProgress(f"{run}/{step} part {part}: another worker is copying it to "
                                     f"tier {dst_tier} (replica {rep.id}, {rep.state})")
            with held:
                clear_prior(cat, dst, ck, part, manifest, prior, held=held, src_tier=src_tier, actor=actor)
                shown = reporter(f"{run}/{step} part {part}: {hop}", manifest.total_bytes)
                if source is not None:
                    source.copying()
                try:
                    with stage(cat, dst, ck, part, held) if stage is not None else nullcontext() as landing:
                        report = transfer.copy_part(src, prefix, dst, prefix if landing is None else landing.key,
                                                    manifest, parallelism=settings.copy_parallelism,
                                                    progress=held.progress(shown), check_source=check_source,
                                                    buffer_bytes=settings.io_buffer_bytes,
                                                    priority=copy_priority(settings),
                                                    confirm=None if found is None else found.result)
                        if landing is not None:
                            held.check()  # a claim lost meanwhile (taken over after a stall) publishes nothing
                            landing.publish(manifest)
                except SourceMismatch as exc:  # nothing of a bad source stays on Tier 1
                    _retract(cat, dst, run, step, part, exc.published, held=held, actor=actor, attempt=ck.attempt,
                             reason=f"its tier {src_tier} source {exc.path} does not match the manifest")
                    raise
                if source is not None:  # Tier 0 first: its bytes are what the copy just proved
                    source.matched(report.seconds)
                held.verified(bytes=report.bytes, seconds=report.seconds,
                              first_byte_seconds=report.first_byte_seconds,
                              reason=f"copied from tier {src_tier} and read back")
            watch_headroom(settings, dst, dst_tier, prefix, ck, part=part, node=node)
    event = events.PROMOTED if Tier(dst_tier).shared_fs else events.VERIFIED
    events.announce(event, run, step, part=part, parts=ck.parts, node=node, extra_id=f"tier{dst_tier}",
                    payload={"tier": dst_tier, "bytes": report.bytes, "seconds": round(report.seconds, 3),
                             "url": url})
    copied = HopResult(hop=hop, run=run, step=step, part=part, files=report.files, bytes=report.bytes,
                       seconds=report.seconds, skipped=False)
    return [copied] if source is None else [source.hop(), copied]


def _source_manifest(cat: Catalog, src: TierStore, ck: CheckpointInfo, part: int,
                     side: ThreadPoolExecutor) -> tuple[Manifest, Future[Manifest] | None]:
    """The manifest to copy by and, while it is still being read, the source's own to commit.
    From a store read in place: the source's manifest, proven against the catalog, before a
    byte moves. From an object store, where every request waits for its first byte: the
    catalog's file list now and the source's manifest read while the files stream
    (``copy_part(confirm=...)``), one round trip less before the first byte."""
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    if src.in_place(prefix) is not None:
        return registered_manifest(cat, src, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt), None
    found = side.submit(registered_manifest, cat, src, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt)
    return catalog_manifest(cat, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt), found


class _Tier0Source:
    """The Tier 0 side of a fused promotion: the part's replica on this node, claimed as a
    verify before anything is read (as ``verify_replica`` does), and the verdict of the copy
    that reads it: ``verified`` only once every byte matched the manifest on its way to Tier
    1; ``corrupt`` / ``missing`` exactly as ``verify_replica`` records them (same event, same
    exception). Held by another worker or already verified: the copy still proves the bytes,
    only the record is left to that holder. A copy that fails for a reason of its own (Tier 1
    full, its read-back) reads Tier 0 back alone, so the Tier 0 replica ends as before the
    fusion; only then, on that failure path, is a source byte read twice."""

    def __init__(self, cat: Catalog, ck: CheckpointInfo, store: TierStore, part: int, node: str, actor: str,
                 settings: Settings):
        self.cat, self.ck, self.store, self.part, self.node, self.actor = cat, ck, store, part, node, actor
        self.prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
        self.url = store.url_for(self.prefix)
        self.lease_s, self._settings = settings.claim_lease_seconds, settings
        self.held: ClaimedCopy | None = None
        self.in_copy = False  # in the copy only the source's own faults are verdicts on it
        self.seconds = 0.0
        self._manifest: Manifest | None = None

    def __enter__(self) -> Self:
        self.held, _ = ClaimedCopy.take(self.cat, self.ck.id, 0, self.part, self.url, node=self.node,
                                        actor=self.actor, what="tier 0 check (by the copy to tier 1)",
                                        lease_s=self.lease_s, stall_s=self._settings.copy_stall_seconds)
        if self.held is not None:
            self.held.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc is not None and not self._verdict(exc):
                self._after_copy_failed(exc)
        finally:
            if self.held is not None:
                self.held.__exit__(exc_type, exc, tb)

    def _after_copy_failed(self, exc: BaseException) -> None:
        """The copy stopped for a reason of its own (Tier 1 full, its read-back, a lost claim)
        before it read every source byte: Tier 0 is read back alone, so its replica ends as a
        verify before the copy would have left it. A bad source found so raises its verdict."""
        if not (self.in_copy and isinstance(exc, Exception) and self.held is not None and not self.held.settled):
            return
        try:
            self.verify_alone(self._settings)
        except (CorruptCheckpoint, PathEscape, NotFound) as bad:
            self.in_copy = False
            self._verdict(bad)
            raise bad from exc
        except Exception as other:  # noqa: BLE001 - the copy's own error is what the caller hears
            log.warning("%s/%s part %s: tier 0 not read back after the copy failed: %s",
                        self.ck.run, self.ck.step, self.part, other)

    def _verdict(self, exc: BaseException) -> bool:
        """Record ``exc`` when it is a verdict on the Tier 0 source; True if it was one."""
        ck, part = self.ck, self.part
        if isinstance(exc, NotFound):
            record_bad(self.cat, ck, 0, part, self.node, self.url, MISSING, exc, self.actor, self.held)
        elif isinstance(exc, SourceMismatch) or (not self.in_copy and isinstance(exc, (CorruptCheckpoint, PathEscape))):
            record_bad(self.cat, ck, 0, part, self.node, self.url, CORRUPT, exc, self.actor, self.held)
            events.announce(events.CORRUPT, ck.run, ck.step, part=part, parts=ck.parts, node=self.node,
                            extra_id="tier0", payload={"tier": 0, "file": getattr(exc, "path", None),
                                                       "reason": str(exc)})
        else:
            return False
        return True

    def manifest(self) -> Manifest:
        """The registered manifest; the part's format checked on Tier 0 (headers only)."""
        started = time.monotonic()
        m = registered_manifest(self.cat, self.store, self.ck.id, self.ck.run, self.ck.step, self.part,
                                self.ck.parts, attempt=self.ck.attempt)
        formats.validate(m.format, {f.path: f.size for f in m.files},
                         lambda rel: self.store.open_read(f"{self.prefix}/{rel}"), complete=m.parts == 1)
        self.seconds += time.monotonic() - started
        self._manifest = m
        return m

    def copying(self) -> None:
        self.in_copy = True

    def verify_alone(self, settings: Settings) -> None:
        """Read Tier 0 back on its own (no copy to read it) and record the verdict."""
        assert self._manifest is not None
        report = transfer.verify_part(self.store, self.prefix, self._manifest,
                                      parallelism=settings.copy_parallelism,
                                      buffer_bytes=settings.io_buffer_bytes, priority=copy_priority(settings))
        self._record(report.seconds, "tier 0 copy read back against its manifest")

    def matched(self, copy_seconds: float) -> None:
        """Every byte the copy read matched: the Tier 0 replica is ``verified``."""
        self._record(copy_seconds, "tier 0 bytes matched their manifest as they were copied to tier 1")

    def _record(self, seconds: float, reason: str) -> None:
        assert self._manifest is not None
        self.seconds += seconds
        if self.held is not None:
            self.held.verified(bytes=self._manifest.total_bytes, reason=reason)
        events.announce(events.VERIFIED, self.ck.run, self.ck.step, part=self.part, parts=self.ck.parts,
                        node=self.node, extra_id="tier0",
                        payload={"tier": 0, "bytes": self._manifest.total_bytes, "seconds": round(self.seconds, 3)})

    def hop(self) -> HopResult:
        assert self._manifest is not None
        return HopResult(hop="verify tier 0", run=self.ck.run, step=self.ck.step, part=self.part,
                         files=len(self._manifest.files), bytes=self._manifest.total_bytes, seconds=self.seconds)


def _retract(cat: Catalog, store: TierStore, run: str, step: int, part: int, keys: list[str], *,
             held: ClaimedCopy, actor: str, reason: str, attempt: str = "") -> None:
    """Delete the files a failed copy published (its part never committed), audited first and
    fenced under its claim (``tasks.base.fenced_delete``); paths another live part of the
    checkpoint lists on this tier stay. A single-part checkpoint's folder left with nothing in
    it goes too (the copy created it)."""
    ck = cat.get_checkpoint(run, step, attempt)
    prefix = checkpoint_prefix(run, step, attempt)
    keep = {f"{prefix}/{p}" for p in shared_paths(cat, ck.id, part, store.tier)} if keys else set()
    doomed = [k for k in keys if k not in keep]
    try:
        if doomed:
            cat.record_deletion(f"files:{run}/{step}/part-{part}@tier{store.tier}",
                                f"{len(doomed)} uncommitted file(s): {reason}", actor=actor, run=run, step=step)
        with uninterrupted():  # never cut short for a stall: see tasks.base.delete_part
            if doomed:
                fenced_delete(store, prefix, [k[len(prefix) + 1:] for k in doomed], token=held.token,
                              check=held.check)
            if ck.parts == 1 and not store.keys(prefix):  # under the claim: no other copy of it runs
                store.delete_prefix(prefix)
    except Exception as exc:  # noqa: BLE001 - the source's verdict is what the caller must hear
        log.warning("%s/%s part %s: could not retract %d uncommitted file(s) from tier %s: %s",
                    run, step, part, len(doomed), store.tier, exc)


def promote_part(settings: Settings, run: str, step: int, part: int = 0, *,
                 node: str | None = None, actor: str = "cli", attempt: str | None = None) -> list[HopResult]:
    """Tier 0 -> Tier 1 reading Tier 0 once: the copy is the Tier 0 verify (``verify tier 0``
    then ``tier 0 -> tier 1`` in the hop list, as the two steps report them). A source
    mismatch leaves nothing on Tier 1 and the Tier 0 replica ``corrupt``; a part already
    verified on Tier 1 gets the Tier 0 verify alone."""
    try:
        return _claimed_copy(settings, run, step, part, src_tier=0, dst_tier=1, node=node or settings.node,
                             actor=actor, check_source=True, attempt=attempt)
    except SourceMismatch as exc:  # recorded: the caller hears what verify_replica raises
        raise CorruptCheckpoint(str(exc), path=exc.path) from None


def watch_headroom(settings: Settings, store: TierStore, tier: int, prefix: str, ck: CheckpointInfo, *,
                   part: int, node: str) -> None:
    """A local destination tier whose free space, now that this part landed, is below
    ``settings.tier_low_headroom_checkpoints`` checkpoints of this size: a warning and
    ``ckpt.tier.low`` once per crossing (per process). An object store has no such number."""
    where = store.local_path(prefix)
    if where is None:
        return
    try:
        reading = Reading(tier, free_bytes(where), ck.total_bytes, settings.tier_low_headroom_checkpoints)
    except OSError as exc:  # a warning's input; never a reason to fail a copy already verified
        log.warning("free space of tier %d at %s not known: %s", tier, store.root_url, exc)
        return
    if headroom(tier, store.root_url).crossed(reading):
        log.warning("tier %d at %s is low: %d bytes free, %.1f checkpoints of %s/%d (the line is %g)", tier,
                    store.root_url, reading.free_after, reading.headroom, ck.run, ck.step, reading.threshold)
        events.announce(events.TIER_LOW, ck.run, ck.step, part=part, parts=ck.parts, node=node,
                        payload=events.tier_low_payload(reading), labels={"tier": tier}, extra_id=f"tier{tier}")


def copy_to_tier1(settings: Settings, run: str, step: int, part: int = 0, *,
                  node: str | None = None, actor: str = "cli") -> HopResult:
    """Tier 0 (this node) -> Tier 1."""
    return copy_between_tiers(settings, run, step, part, src_tier=0, dst_tier=1, node=node, actor=actor)


def upload_to_tier2(settings: Settings, run: str, step: int, part: int = 0, *,
                    node: str | None = None, actor: str = "cli") -> HopResult:
    """Tier 1 -> Tier 2 (milestones; the archive flow decides)."""
    return copy_between_tiers(settings, run, step, part, src_tier=1, dst_tier=2, node=node, actor=actor)

