"""resume: the one call a training node makes on start, the newest checkpoint it can load and a
local folder to load it from, taken from the cheapest good source of each part it needs.

Contract of ``resume``:
- The newest committed checkpoint of the run (never a retired or partial one) whose wanted
  parts (``part``, or every part) all have a good copy; ``None`` when the run has none yet.
- Sources, cheapest first (``plan_sources``): this node's own Tier 0 copy in place; the Tier 1
  folder in place when Tier 1 is a path mounted here; else a fetch (Tier 1, then Tier 2) into
  this node's Tier 0 under the layout, recorded there as a verified replica under a claim (the
  next resume then finds case 1), or into ``to`` (absent or empty; filled atomically).
- A fetch into a tier that is a folder here (Tier 0; Tier 1 rehydrated) is staged whole in a
  hidden folder beside the checkpoint's and renamed into place (``claimed_fetch``): killed
  midway, it leaves none of the part's files under their names; the next claim of the part
  removes what it left. (Into an object store: files, then the manifest as the commit marker.)
- "Good" means the copy is verified in the catalog, its manifest still lists exactly the files
  the catalog registered, and every file has the registered size (``verify="full"``: and the
  registered CRC32C, read back now). A copy that fails is marked ``corrupt``/``missing`` and the
  next source is tried; a checkpoint with no good copy gives way to the previous one, said in
  ``ResumePoint.note``.
- A part brings only its own files plus the checkpoint-wide files its format needs to load
  (DCP ``.metadata``, the HF index), from whichever part holds them.
- A fetch from Tier 2 whose Tier 1 copy is gone first rehydrates Tier 1 as a claimed copy
  (``claimed_fetch``): of N nodes resuming at once one reads S3, the others
  wait for its claim and read Tier 1. A rehydration that fails for a storage reason (Tier 1
  full or unreachable) is "not rehydrated": a warning and ``ckpt.resume.rehydrate_failed``, and
  the part is fetched into this node's Tier 0 (or ``to``) as if Tier 1 were not configured.
- It records nothing but replicas: resuming a run is not a new run.
- A folder under ``<data_dir>/resume/<run>/`` (the fetch of a node whose part another node holds
  on Tier 0; no replica row) is scratch: once a resume of the run from step N succeeds, the
  run's folders of older steps there go (``tidy_resume_folders``): a node keeps the newest.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from core import events, transfer
from core.checksum import hash_file
from core.errors import (
    BadInput,
    ConflictError,
    CopyInProgress,
    CorruptCheckpoint,
    NotFound,
    PathEscape,
    StorageFull,
    StorageUnavailable,
    UnknownRun,
)
from core.formats import WIDE_FILES
from core.layout import (
    STAGING_MARK,
    checkpoint_dirname,
    checkpoint_prefix,
    is_staging,
    manifest_name,
    parse_step_dirname,
    staging_name,
)
from core.manifest import MAX_MANIFEST_BYTES, Manifest
from core.paths import safe_run_name
from core.settings import Settings
from core.storage.base import TierStore, hash_object
from core.storage.local import fsync_dir
from core.storage.stage import RestoreStage, publish
from core.tiers import ALL_TIERS, Tier, readable_from
from db.catalog import Catalog
from db.entities import COPYING, VERIFIED, CheckpointInfo, FileInfo, ReplicaInfo
from tasks.base import (
    HopResult,
    catalog_digest,
    catalog_manifest,
    copy_priority,
    log,
    open_catalog,
    open_tier,
    registered_manifest,
)
from tasks.claim import ClaimedCopy
from tasks.copy import clear_prior, copy_between_tiers, watch_headroom
from tasks.replicas import BadReplica, TierStores, classify_failure, mark_bad
from tasks.restore import _fetch_part, _PartFailed, candidates, ensure_empty_target
from tasks.verify import part_replica

Verify = Literal["size", "full"]
IN_PLACE, FETCHED = "in place", "fetched"
HYDRATION_POLL_S = 0.2
CLAIM_WAIT_GRACE_S = 30.0  # beyond two leases of silence from a claim's holder before giving up on it
STAGE_AGE_S = 3600.0  # a resume's stage folder older than this was left by a killed resume


@dataclass(frozen=True)
class PartResume:
    """Where one part came from: ``tier``, ``source`` (in place | fetched), bytes moved now."""
    part: int
    tier: int
    source: str
    bytes_moved: int
    seconds: float


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from and the local folder holding it."""
    run: str
    step: int
    path: str
    parts: list[PartResume] = field(default_factory=list)
    note: str | None = None  # set when it fell back to an older step, and why

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "path": self.path,
                "parts": [asdict(p) for p in self.parts], "note": self.note}


@dataclass(frozen=True)
class Source:
    """One way to get a part: read ``tier`` in place, or fetch from it."""
    tier: int
    in_place: bool
    replica: ReplicaInfo


class _NoGoodCopy(Exception):
    """Every source of a wanted part failed (each already marked in the catalog)."""


class _HeldElsewhere(Exception):
    """Another node won the claim on a wanted part's Tier 0 row: its copy is on that node's NVMe."""


def plan_sources(replicas: Iterable[ReplicaInfo], part: int, *, node: str, configured: set[int],
                 local: set[int]) -> list[Source]:
    """The sources of ``part``, cheapest first: this node's Tier 0 copy (in place), Tier 1 (in
    place where ``local``, else fetched), Tier 2 (fetched). Only verified replicas of configured
    tiers; Tier 0 only on its own node and only as a local folder."""
    verified = {Tier(r.tier): r for r in replicas if r.part == part and r.state == VERIFIED and r.tier in configured
                and readable_from(r.tier, r.node, node)}
    return [Source(t, t in local and not t.object_store, verified[t]) for t in ALL_TIERS
            if t in verified and (t in local or not t.node_local)]


def wanted_parts(ck: CheckpointInfo, part: int | None, parts: int | None) -> list[int]:
    """The parts this caller needs: ``part`` (checked against ``parts`` and the checkpoint), or all."""
    if parts is not None and parts != ck.parts:
        raise BadInput(f"{ck.run}/step-{ck.step} has {ck.parts} part(s), the job says --parts {parts}")
    if part is None:
        return list(range(ck.parts))
    if not 0 <= part < ck.parts:
        raise BadInput(f"part {part} out of range: {ck.run}/step-{ck.step} has {ck.parts} part(s)")
    return [part]


def wanted_files(cat: Catalog, ck: CheckpointInfo, wanted: Sequence[int]) -> list[FileInfo]:
    """The files of the wanted parts and every checkpoint-wide file (``WIDE_FILES``), whichever
    part holds it: for one part, that part's rows alone (at thousands of nodes each node's
    resume reads its own share of the catalog, not the whole checkpoint's)."""
    if len(wanted) == 1:
        return cat.files(ck.id, wanted[0], also_paths=WIDE_FILES)
    return cat.files(ck.id)


def wide_files(files: Sequence[FileInfo], wanted: Sequence[int]) -> list[FileInfo]:
    """Checkpoint-wide files (``WIDE_FILES``) that another part holds, one per path."""
    own = {f.path for f in files if f.part in wanted}
    seen: dict[str, FileInfo] = {}
    for f in files:
        if f.path in WIDE_FILES and f.path not in own and f.part not in wanted:
            seen.setdefault(f.path, f)
    return list(seen.values())


def resume(settings: Settings, run: str, *, part: int | None = None, parts: int | None = None,
           to: str | Path | None = None, verify: Verify = "size", actor: str = "resume",
           attempt: str | None = None) -> ResumePoint | None:
    """The resume point of ``run`` for this node; see the module contract. ``attempt``: the
    launch that resumes (``core.attempt``), recorded with the step it resumes from, so that
    older attempts' checkpoints above it are superseded (``Catalog.record_resume``); None for a
    look that starts no training (nothing recorded)."""
    safe_run_name(run)
    if verify not in ("size", "full"):
        raise BadInput(f"verify must be 'size' or 'full', not {verify!r}")
    if part is not None and (part < 0 or (parts is not None and part >= parts)):
        raise BadInput(f"part {part} out of range: the job has {parts} part(s)")
    target = Path(to).expanduser().absolute() if to is not None else None
    if target is not None and (target.is_symlink() or (target.exists() and not target.is_dir())):
        raise ConflictError(f"{target} exists and is not a folder; choose another destination")
    notes: list[str] = []
    assert settings.catalog_url is not None  # resolved by Settings
    with open_catalog(settings.catalog_url) as cat, TierStores(settings) as stores:
        if target is not None:
            _outside_managed_folders(stores, run, target)
        try:
            cat.get_run(run)
        except UnknownRun:
            _record(cat, run, attempt, None, actor)
            return None

        newest: int | None = None
        for ck in candidates(cat, run, None, True):
            newest = ck.step if newest is None else newest
            wanted = wanted_parts(ck, part, parts)
            try:
                point = _resume_checkpoint(cat, stores, ck, wanted, target, verify, actor, notes)
            except _NoGoodCopy as exc:
                notes.append(f"step {ck.step}: {exc}")
                log.warning("resume %s: step %d has no good copy (%s); trying the previous checkpoint",
                            run, ck.step, exc)
                continue
            if ck.step != newest:
                point = ResumePoint(point.run, point.step, point.path, point.parts,
                                    f"fell back from step {newest} to step {ck.step}: " + "; ".join(notes))
            log.info("resume %s from step %d at %s", run, ck.step, point.path)
            if target is None:
                tidy_resume_folders(settings, run, step=ck.step)
            _record(cat, run, attempt, ck.step, actor)
            return point
        if newest is None:
            _record(cat, run, attempt, None, actor)
    if newest is None:
        return None
    raise NotFound(f"{run}: no checkpoint has a good copy readable here ({'; '.join(notes)})")


def _record(cat: Catalog, run: str, attempt: str | None, step: int | None, actor: str) -> None:
    if attempt is None:
        return
    superseded = cat.record_resume(run, attempt, step, actor=actor)
    if superseded:
        log.warning("resume %s (attempt %s) from %s: older attempts' steps %s are superseded: they are never "
                    "offered again", run, attempt or "(unnamed)", "scratch" if step is None else f"step {step}",
                    ", ".join(map(str, superseded)))


def _resume_checkpoint(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int],
                       target: Path | None, verify: Verify, actor: str, notes: list[str]) -> ResumePoint:
    """Resume ``ck``: in place where every wanted part is good on one tier, else fetched."""
    settings = stores.settings
    files = wanted_files(cat, ck, wanted)
    wide = wide_files(files, wanted)
    if target is None:
        for tier in (Tier.NODE, Tier.SHARED):
            found = _in_place(cat, stores, ck, tier, wanted, wide, files, verify, actor, notes)
            if found is not None:
                return found
    started = time.monotonic()
    moved = {p: _hydrate(cat, stores, ck, p, actor, notes) for p in wanted}
    if target is None and _local(stores, 1, ck):
        found = _in_place(cat, stores, ck, 1, wanted, wide, files, verify, actor, notes)
        if found is not None:  # rehydrated Tier 1 is mounted here: load it where it is
            return _with_moved(found, moved, started, 2)
    if target is None and _tier0_is_ours(cat, ck, wanted, settings.node):
        try:
            return _fetch_to_tier0(cat, stores, ck, wanted, files, wide, moved, verify, actor, notes)
        except _HeldElsewhere as exc:  # lost the race for the Tier 0 row: fetched beside it instead
            log.info("resume %s/step-%d: %s; fetching beside this node's Tier 0", ck.run, ck.step, exc)
    dest = target or resume_root(settings, ck.run) / checkpoint_dirname(ck.step)
    return _fetch_to_folder(cat, stores, ck, wanted, files, wide, dest, moved, verify, actor, notes,
                            scratch=target is None)


def _outside_managed_folders(stores: TierStores, run: str, target: Path) -> None:
    """``ConflictError`` when ``to`` lies in a folder this system manages: a tier mounted here (a
    checkpoint copied there would look committed to that tier) or this node's resume folders
    (tidied by the next resume)."""
    managed = [(f"tier {t}", root.parent) for t in (0, 1, 2) if stores.configured(t)
               and (root := stores.in_place(t, run)) is not None]
    managed.append(("this node's resume folders", resume_root(stores.settings, run).parent))
    where = target.resolve()
    for name, folder in managed:
        if where.is_relative_to(folder.resolve()):
            raise ConflictError(f"{target} is inside {name} ({folder}); resume into a folder of your own")


def resume_root(settings: Settings, run: str) -> Path:
    """This node's scratch folder for ``run``'s checkpoints fetched beside Tier 0."""
    return settings.data_dir.expanduser().absolute() / "resume" / safe_run_name(run)


def tidy_resume_folders(settings: Settings, run: str, *, step: int) -> int:
    """After a resume of ``run`` from ``step`` succeeded, remove the run's folders of older steps
    under ``resume_root`` and the stage folders of older steps a killed resume left (older than
    ``STAGE_AGE_S``; a younger one may be a sibling's fetch in flight). Newer steps' folders stay
    (a sibling worker that saw a newer checkpoint may be loading one). Only names of the layout;
    a link is removed itself, never followed. Best effort: a failure is logged, the resume stands.
    Returns how many went."""
    base = resume_root(settings, run)
    if base.is_symlink() or not base.is_dir():
        return 0
    cutoff, removed = time.time() - STAGE_AGE_S, 0
    for entry in sorted(base.iterdir()):
        name = entry.name
        stage = name.startswith(".") and ".resume-" in name
        older = parse_step_dirname(name[1:].split(".resume-")[0] if stage else name)
        try:
            if older is None or older >= step or (stage and entry.lstat().st_mtime >= cutoff):
                continue
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink()
            else:
                shutil.rmtree(entry)  # unlinks links inside, never descends them
            removed += 1
        except FileNotFoundError:  # a sibling worker tidied it first
            continue
        except OSError as exc:
            log.warning("resume %s: could not remove the old resume folder %s: %s", run, entry, exc)
    if removed:
        log.info("resume %s: removed %d older resume folder(s) under %s", run, removed, base)
    return removed


# --- in place --------------------------------------------------------------------------------
def _local(stores: TierStores, tier: int, ck: CheckpointInfo) -> bool:
    """Whether ``tier`` is a folder mounted here (its checkpoints can be read where they lie)."""
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    return stores.configured(tier) and stores.in_place(tier, prefix) is not None


def _sources(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int) -> list[Source]:
    configured = {t for t in (0, 1, 2) if stores.configured(t)}
    return plan_sources(cat.replicas(ck.id, part=part), part, node=stores.settings.node, configured=configured,
                        local={t for t in configured if _local(stores, t, ck)})


def _in_place(cat: Catalog, stores: TierStores, ck: CheckpointInfo, tier: int, wanted: list[int],
              wide: list[FileInfo], files: list[FileInfo], verify: Verify, actor: str,
              notes: list[str]) -> ResumePoint | None:
    """``ck`` read where it lies on ``tier`` when every wanted part is good there (a part that
    is not is marked); checkpoint-wide files another part holds are fetched in beside it on Tier 0,
    checked in place on Tier 1."""
    started = time.monotonic()
    chosen = []
    for p in wanted:
        src = next((s for s in _sources(cat, stores, ck, p) if s.tier == tier and s.in_place), None)
        if src is None:
            return None
        chosen.append(src)
    store = stores.get(tier)
    for src in chosen:
        if not _good(cat, store, ck, src, files, verify, actor, notes):
            return None
    moved = 0
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    for f in wide:
        if Tier(tier).node_local:
            moved += _bring_file(cat, stores, ck, f, store, f"{prefix}/{f.path}", actor, notes)
        elif not _wide_good(cat, stores, ck, f, verify, actor, notes):
            return None
    folder = store.in_place(prefix)
    assert folder is not None
    seconds = time.monotonic() - started
    return ResumePoint(ck.run, ck.step, str(folder),
                       [PartResume(s.replica.part, tier, IN_PLACE, moved if i == 0 else 0, seconds)
                        for i, s in enumerate(chosen)])


def _good(cat: Catalog, store: TierStore, ck: CheckpointInfo, src: Source, files: list[FileInfo], verify: Verify,
          actor: str, notes: list[str]) -> bool:
    """Whether the part's copy on ``store`` still matches the registered manifest; marks it if not."""
    part = src.replica.part
    try:
        registered_manifest(cat, store, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt)
        for f in files:
            if f.part == part:
                check_file(store, f"{checkpoint_prefix(ck.run, ck.step, ck.attempt)}/{f.path}", f, verify)
    except (CorruptCheckpoint, NotFound, FileNotFoundError, BadInput) as exc:
        _mark(cat, src.replica, exc, actor, notes)
        return False
    return True


def _wide_good(cat: Catalog, stores: TierStores, ck: CheckpointInfo, f: FileInfo, verify: Verify, actor: str,
               notes: list[str]) -> bool:
    """A checkpoint-wide file of another part, on Tier 1 in place: that part verified there (once
    a rehydration of it in flight has ended: ``await_copy``), the file intact."""
    await_copy(cat, stores.settings, ck, f.part, 1)
    src = next((s for s in _sources(cat, stores, ck, f.part) if s.tier == Tier.SHARED and s.in_place), None)
    if src is None:
        return False
    try:
        check_file(stores.get(1), f"{checkpoint_prefix(ck.run, ck.step, ck.attempt)}/{f.path}", f, verify)
    except (CorruptCheckpoint, NotFound) as exc:
        _mark(cat, src.replica, exc, actor, notes)
        return False
    return True


def check_file(store: TierStore, key: str, f: FileInfo, verify: Verify) -> None:
    """``CorruptCheckpoint`` unless ``key`` has the registered size (and CRC32C with ``full``)."""
    info = store.stat(key)
    if info is None:
        raise CorruptCheckpoint(f"{f.path}: missing from {store.url_for(key)}", path=f.path)
    if info.size != f.size:
        raise CorruptCheckpoint(f"{f.path}: size {info.size} != manifest {f.size}", path=f.path)
    if verify == "full":
        size, crc = hash_object(store, key, store.buffer_bytes)
        if (size, crc) != (f.size, f.checksum):
            raise CorruptCheckpoint(f"{f.path}: crc32c {crc} != manifest {f.checksum}", path=f.path)


def _mark(cat: Catalog, replica: ReplicaInfo, exc: BaseException, actor: str, notes: list[str]) -> None:
    state = classify_failure(exc) or "corrupt"
    bad = mark_bad(cat, replica, state, f"resume: {exc}", actor=actor)
    recorded = "marked in the catalog" if bad.marked else "not marked: its row changed meanwhile"
    log.warning("resume %s/step-%d part %d: tier %d copy is %s (%s; %s); trying the next copy",
                replica.run, replica.step, replica.part, replica.tier, state, exc, recorded)
    notes.append(f"step {replica.step} part {replica.part}: tier {replica.tier} copy is {state} ({exc}); "
                 f"{recorded}, trying the next copy")


# --- fetched ---------------------------------------------------------------------------------
def _hydrate(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int, actor: str,
             notes: list[str]) -> int:
    """When the part's only fetchable copy is on Tier 2 and Tier 1 is configured, publish a
    verified Tier 1 copy first (one claim per cluster; the others wait for it). Bytes read now."""
    if not stores.configured(1):
        return 0
    srcs = _sources(cat, stores, ck, part)
    if not srcs or any(not Tier(s.tier).object_store for s in srcs):
        return 0
    tier2 = srcs[0]  # the only source there is: the object store's
    try:
        hop = copy_when_free(cat, stores.settings, ck, part, src_tier=2, dst_tier=1, actor=actor)
    except (CorruptCheckpoint, NotFound) as exc:
        _mark(cat, tier2.replica, exc, actor, notes)
        return 0
    except (StorageFull, StorageUnavailable, OSError) as exc:  # Tier 1's trouble, not the copy's
        _not_rehydrated(ck, part, exc, stores.settings.node, notes)
        return 0
    if hop.skipped:
        return 0
    notes.append(f"step {ck.step} part {part}: Tier 1 rehydrated from Tier 2 ({hop.bytes} bytes)")
    return hop.bytes


def _not_rehydrated(ck: CheckpointInfo, part: int, exc: BaseException, node: str, notes: list[str]) -> None:
    """A rehydration that failed for a reason of Tier 1's (full, unreachable): the part is "not
    rehydrated" (the claim released it, nothing published) and the resume goes on to fetch it
    into this node's folder; the operator is told (a warning, ``ckpt.resume.rehydrate_failed``)."""
    log.warning("resume %s/step-%d part %d: Tier 1 not rehydrated (%s: %s); fetching from Tier 2 into this "
                "node's folder instead", ck.run, ck.step, part, type(exc).__name__, exc)
    notes.append(f"step {ck.step} part {part}: Tier 1 not rehydrated ({exc})")
    events.announce(events.REHYDRATE_FAILED, ck.run, ck.step, part=part, parts=ck.parts, node=node,
                    extra_id="tier1", payload={"tier": 1, "error": f"{type(exc).__name__}: {exc}"[:500]})


def await_copy(cat: Catalog, settings: Settings, ck: CheckpointInfo, part: int, tier: int) -> str | None:
    """Wait while another worker copies ``part`` to ``tier`` (its replica ``copying``), so a
    checkpoint-wide file of that part is read from the copy it is publishing, not once more from
    S3 by every node: the cluster reads each object once. Gives up, as ``copy_when_free`` does,
    after two leases and ``CLAIM_WAIT_GRACE_S`` without a sign of the holder. Returns the row's
    state when the wait ended (None: no row)."""
    silence = 2 * settings.claim_lease_seconds + CLAIM_WAIT_GRACE_S
    deadline, seen = time.monotonic() + silence, None
    while True:
        row = next(iter(cat.replicas(ck.id, tier, part)), None)
        if row is None or row.state != COPYING:
            return None if row is None else row.state
        sign = (row.claim_token, row.updated_at)
        if sign != seen:
            seen, deadline = sign, time.monotonic() + silence
        if time.monotonic() > deadline:
            return row.state
        time.sleep(HYDRATION_POLL_S)


def copy_when_free(cat: Catalog, settings: Settings, ck: CheckpointInfo, part: int, *, src_tier: int,
                   dst_tier: int, actor: str) -> HopResult:
    """``claimed_fetch`` (a claimed copy), waiting while another worker holds the claim:
    until it publishes (then: a skipped hop) or its lease lapses (then: taken over). Asks the
    catalog every ``HYDRATION_POLL_S``; retries the claim (which reads the source's manifest)
    only every fifth of a lease. A holder that keeps renewing its lease is waited for however
    long its copy takes (each renewal moves the row's ``updated_at``); ``CopyInProgress`` only
    after two leases and ``CLAIM_WAIT_GRACE_S`` without a sign of it. Monotonic clock only."""
    silence = 2 * settings.claim_lease_seconds + CLAIM_WAIT_GRACE_S
    deadline = time.monotonic() + silence
    next_try, seen = 0.0, None
    while True:
        row = next(iter(cat.replicas(ck.id, dst_tier, part)), None)
        sign = None if row is None else (row.state, row.claim_token, row.updated_at)
        if sign != seen:  # the holder renewed, or the claim changed hands: it is alive
            seen, deadline = sign, time.monotonic() + silence
        if row is not None and row.state == COPYING and time.monotonic() < next_try:
            time.sleep(HYDRATION_POLL_S)
            continue
        try:
            return claimed_fetch(settings, ck, part, src_tier=src_tier, dst_tier=dst_tier, actor=actor)
        except CopyInProgress:
            if time.monotonic() > deadline:
                raise
            next_try = time.monotonic() + settings.claim_lease_seconds / 5


def claimed_fetch(settings: Settings, ck: CheckpointInfo, part: int, *, src_tier: int, dst_tier: int,
                  actor: str) -> HopResult:
    """One part copied to ``dst_tier`` as a claimed copy. Into a tier that is a folder here, the
    part is fetched whole into a hidden stage beside the checkpoint's folder and renamed into
    place (``_staged_copy``): a fetch killed midway leaves none of the part's files under their
    names. Into an object store (no rename there) ``copy_between_tiers``: files, manifest last."""
    with open_tier(settings, dst_tier) as dst:
        if dst.in_place(checkpoint_prefix(ck.run, ck.step)) is not None:
            return _staged_copy(settings, ck, part, dst, src_tier=src_tier, actor=actor)
    return copy_between_tiers(settings, ck.run, ck.step, part, src_tier=src_tier, dst_tier=dst_tier,
                              node=settings.node, actor=actor)


def stage_label(step: int, part: int, parts: int) -> str:
    """What a part's fetch stage is named for, after the ``staging_name`` mark:
    ``step-00000100.part-00000-of-00001``. The stage lies in the run's folder, beside the step's."""
    return f"{checkpoint_dirname(step)}.part-{part:05d}-of-{parts:05d}"


def _staged_copy(settings: Settings, ck: CheckpointInfo, part: int, dst: TierStore, *, src_tier: int,
                 actor: str) -> HopResult:
    """``copy_between_tiers`` into the folder tier ``dst``, published whole: under the part's
    claim, the stages a dead fetch of this part left are removed (the claim proves their writer
    is gone: a live one would hold it), the files are copied into a fresh stage
    ``<run>/.ckpt-staging-<pid>-<id>-<stage_label>`` (each read back as ``put_verified`` does,
    the manifest last) and the stage is renamed onto the step's folder (``_publish_stage``);
    only then is the replica ``verified``. A failure removes the stage; a kill leaves it to the
    next claim."""


    run, step, tier, node = ck.run, ck.step, dst.tier, settings.node
    hop = f"tier {src_tier} -> tier {tier}"
    prefix = checkpoint_prefix(run, step)
    url = dst.url_for(prefix)
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, src_tier) as src, \
            ThreadPoolExecutor(1, thread_name_prefix="manifest") as side:
        # the files to fetch are the catalog's; the source's manifest (the one to commit, proven
        # against the catalog) is read while they stream: on S3 one round trip less before the
        # first byte. A source without its manifest fails the copy before anything is published.
        found = side.submit(registered_manifest, cat, src, ck.id, run, step, part, ck.parts)
        manifest = catalog_manifest(cat, ck.id, run, step, part, ck.parts, attempt=ck.attempt)
        prior = part_replica(cat, ck.id, tier, part, None)
        held, rep = ClaimedCopy.take(cat, ck.id, tier, part, url, node=node if Tier(tier).node_local else None,
                                     actor=actor, lease_s=settings.claim_lease_seconds,
                                     stall_s=settings.copy_stall_seconds)
        if held is None:
            found.cancel()
            if rep.state == VERIFIED:
                return HopResult(hop=hop, run=run, step=step, part=part, files=len(manifest.files),
                                 bytes=manifest.total_bytes, seconds=0.0, skipped=True)
            raise CopyInProgress(f"{run}/{step} part {part}: another worker is copying it to "
                                 f"tier {tier} (replica {rep.id}, {rep.state})")
        with held:
            clear_prior(cat, dst, ck, part, manifest, prior, held=held, src_tier=src_tier, actor=actor)
            _sweep_stages(cat, dst, ck, part, actor)
            stage_key = f"{run}/{staging_name(stage_label(step, part, ck.parts))}"
            stage = dst.write_path(stage_key)
            try:
                report = transfer.copy_part(src, prefix, dst, stage_key, manifest,
                                            parallelism=settings.copy_parallelism, progress=held.progress(),
                                            buffer_bytes=settings.io_buffer_bytes, priority=copy_priority(settings),
                                            confirm=found.result)
                held.check()  # a claim lost meanwhile (taken over after a stall) publishes nothing
                _publish_stage(stage, dst.write_path(prefix), manifest)
            finally:
                shutil.rmtree(stage, ignore_errors=True)  # gone already when published
            held.verified(bytes=report.bytes, seconds=report.seconds,
                          reason=f"copied from tier {src_tier} and read back")
        watch_headroom(settings, dst, tier, prefix, ck, part=part, node=node)
    events.announce(events.PROMOTED if Tier(tier).shared_fs else events.VERIFIED, run, step, part=part, parts=ck.parts,
                    node=node, extra_id=f"tier{tier}",
                    payload={"tier": tier, "bytes": report.bytes, "seconds": round(report.seconds, 3), "url": url})
    return HopResult(hop=hop, run=run, step=step, part=part, files=report.files, bytes=report.bytes,
                     seconds=report.seconds, skipped=False)


def _sweep_stages(cat: Catalog, dst: TierStore, ck: CheckpointInfo, part: int, actor: str) -> int:
    """Remove the stages of ``part`` of ``ck`` in the run's folder on ``dst``: called under the
    part's claim, so each was left by a fetch that died (or lost the claim). Audited; a link is
    removed itself, never followed. Stages of other parts and steps are never touched."""
    label = stage_label(ck.step, part, ck.parts)
    dead = [e for e, found in _stages(dst, ck.run) if found == (ck.step, part, ck.parts)]
    return _remove_stages(cat, dst, ck.run, ck.step, part, dead, actor,
                          f"{len(dead)} stage folder(s) of part {part}: left by a resume's fetch that died ({label})")


_STAGE = re.compile(r"^step-(?P<step>\d{8,})\.part-(?P<part>\d{5})-of-(?P<parts>\d{5})$", re.ASCII)


def _stages(dst: TierStore, run: str) -> list[tuple[Path, tuple[int, int, int]]]:
    """The fetch stages in ``run``'s folder on the folder tier ``dst``, with the (step, part,
    parts) each is for; an entry of another shape is not a stage and is left alone, and a folder
    whose name is not a run's (``lost+found``) holds none."""
    try:
        folder = dst.in_place(safe_run_name(run))
    except (BadInput, PathEscape):
        return []
    if folder is None or folder.is_symlink():
        return []
    try:
        entries = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for e in entries:
        m = _STAGE.match(e.name[len(STAGING_MARK):].split("-", 2)[-1]) if is_staging(e.name) else None
        if m is not None:
            found.append((e, (int(m["step"]), int(m["part"]), int(m["parts"]))))
    return found


def _remove_stages(cat: Catalog, dst: TierStore, run: str, step: int, part: int, dead: list[Path], actor: str,
                   reason: str) -> int:
    """Remove ``dead`` stage folders (audited before the first byte goes; a link is removed
    itself, never followed; one a sibling removed first is skipped)."""
    if not dead:
        return 0
    cat.record_deletion(f"staging:{run}/{step}@tier{dst.tier}", reason, actor=actor, run=run, step=step)
    for entry in dead:
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)
    log.info("%s/step-%d part %d: removed %d stage folder(s) a dead fetch left on tier %d",
             run, step, part, len(dead), dst.tier)
    return len(dead)


def sweep_dead_stages(cat: Catalog, dst: TierStore, runs: Iterable[str], *, node: str, actor: str) -> int:
    """Reconcile's sweep of the fetch stages in ``runs``' folders on the folder tier ``dst``
    whose writer is gone, so a resume killed mid-fetch leaves no garbage even when that part is
    never fetched again (its checkpoint retired, say). A stage is created only under its part's
    claim and is gone (renamed, or removed) before the claim ends, so one whose part's replica on
    ``dst`` is not ``copying`` (run after ``recover_claims``, which ends claims past their lease)
    was left by a fetch that died; a stage of a live claim, or of a checkpoint it cannot place,
    is left alone (the latter once ``STAGE_AGE_S`` old goes: no claim can hold it). The stages
    are listed before the rows are read: one made after the listing is not considered. Returns
    how many went."""
    removed = 0
    for run in runs:
        stages = _stages(dst, run)
        by_part: dict[tuple[int, int, int], list[Path]] = {}
        for entry, found in stages:
            by_part.setdefault(found, []).append(entry)
        for (step, part, _parts), entries in sorted(by_part.items()):
            try:
                ck = cat.get_checkpoint(run, step)
            except (NotFound, UnknownRun):
                cutoff = time.time() - STAGE_AGE_S
                entries = [e for e in entries if _mtime(e) < cutoff]
                removed += _remove_stages(cat, dst, run, step, part, entries, actor,
                                          f"{len(entries)} stage folder(s) of part {part}: of a checkpoint the "
                                          f"catalog does not know, older than {STAGE_AGE_S:.0f} s")
                continue
            rows = [r for r in cat.replicas(ck.id, dst.tier)
                    if r.part == part and readable_from(dst.tier, r.node, node)]
            if any(r.state == COPYING for r in rows):
                continue  # a live claim (or one whose lease has not lapsed yet): its writer may be at work
            removed += _remove_stages(cat, dst, run, step, part, entries, actor,
                                      f"{len(entries)} stage folder(s) of part {part}: left by a resume's fetch "
                                      "that died (no claim holds the part)")
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _publish_stage(stage: Path, folder: Path, manifest: Manifest) -> None:
    """Put a part's complete ``stage`` in place: one rename onto ``folder`` when that is absent
    (or empty); else (other parts' files are there) each file hard-linked in beside them, data
    first, the manifest (the part's commit marker) last, each step made durable before the next.
    Never replaces a file: one already there must have the registered bytes (``ConflictError``).
    All or nothing: a link that fails (a conflict, a full or read-only folder) takes back the
    links this call made, and the folders it created, before the error goes on; a kill midway
    leaves some data files linked in but no manifest (the part uncommitted), which the next claim
    of the part removes (``clear_prior``) as it does a killed copy's files."""


    if folder.is_symlink():
        raise PathEscape(f"{folder} is a symlink; a fetch never publishes through a link")
    try:
        os.rename(stage, folder)  # replaces an empty folder atomically; refuses a non-empty one
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    else:
        fsync_dir(folder.parent)
        return
    registered = {e.path: (e.size, e.checksum) for e in manifest.files}
    changed: set[Path] = set()
    made: list[Path] = []  # links and folders this call created, in order

    def link(rel: str) -> None:
        staged, target = stage / rel, folder / rel
        new = [p for p in reversed(target.parents) if p.is_relative_to(folder) and not p.exists()]
        target.parent.mkdir(parents=True, exist_ok=True)
        made.extend(new)
        changed.update(p.parent for p in new)
        try:
            os.link(staged, target)
        except FileExistsError:
            same = (staged.read_bytes() == target.read_bytes() if rel == manifest.name
                    else not target.is_symlink() and hash_file(target) == registered[rel])
            if not same:
                raise ConflictError(f"{target} already exists with other bytes; refusing to overwrite") from None
            return
        made.append(target)
        changed.add(target.parent)

    try:
        for e in manifest.files:
            link(e.path)
        for d in sorted(changed, key=lambda p: -len(p.parts)):
            fsync_dir(d)
        changed.clear()
        link(manifest.name)
        for d in changed:
            fsync_dir(d)
    except BaseException:
        for path in reversed(made):  # links (the stage keeps their bytes) and then the folders made for them
            try:
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
            except OSError:
                log.warning("publish of %s: could not take back %s", folder, path)
        raise


def _with_moved(point: ResumePoint, moved: dict[int, int], started: float, tier: int) -> ResumePoint:
    seconds = time.monotonic() - started
    parts = [PartResume(p.part, tier if moved.get(p.part) else p.tier, FETCHED if moved.get(p.part) else p.source,
                        p.bytes_moved + moved.get(p.part, 0), seconds) for p in point.parts]
    return ResumePoint(point.run, point.step, point.path, parts, point.note)


def _tier0_is_ours(cat: Catalog, ck: CheckpointInfo, wanted: list[int], node: str) -> bool:
    """Whether this node may record a Tier 0 copy of every wanted part (no other node holds one)."""
    found = cat.replicas(ck.id, 0, wanted[0]) if len(wanted) == 1 else cat.replicas(ck.id, 0)
    rows = {r.part: r for r in found}
    return all(p not in rows or rows[p].node in (None, "", node) or rows[p].state != VERIFIED for p in wanted)


def _fetch_to_tier0(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int], files: list[FileInfo],
                    wide: list[FileInfo], moved: dict[int, int], verify: Verify, actor: str,
                    notes: list[str]) -> ResumePoint:
    """Each wanted part copied into this node's Tier 0 from its nearest fetchable source, as a
    claimed copy recorded ``verified``; a source that fails is marked and the next one tried."""
    done = []
    for p in wanted:
        t0 = time.monotonic()
        srcs = _sources(cat, stores, ck, p)
        own = next((s for s in srcs if Tier(s.tier).node_local), None)
        if own is not None and _good(cat, stores.get(0), ck, own, files, verify, actor, notes):
            done.append(PartResume(p, 0, IN_PLACE, 0, time.monotonic() - t0))  # this part is here already
            continue
        for src in [s for s in srcs if not Tier(s.tier).node_local]:
            try:
                hop = copy_when_free(cat, stores.settings, ck, p, src_tier=src.tier, dst_tier=0, actor=actor)
            except (CorruptCheckpoint, NotFound) as exc:
                _mark(cat, src.replica, exc, actor, notes)
                continue
            if hop.skipped and not _tier0_is_ours(cat, ck, [p], stores.settings.node):
                raise _HeldElsewhere(f"part {p}'s Tier 0 copy was just made on another node")
            fetched = 0 if hop.skipped else hop.bytes  # skipped: another worker of this node just fetched it
            done.append(PartResume(p, src.tier if not moved[p] else 2, FETCHED, fetched + moved[p],
                                   time.monotonic() - t0))
            break
        else:
            raise _NoGoodCopy(f"every copy of part {p} failed")
    store = stores.get(0)
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    extra = sum(_bring_file(cat, stores, ck, f, store, f"{prefix}/{f.path}", actor, notes) for f in wide)
    if extra:
        done[0] = PartResume(done[0].part, done[0].tier, done[0].source, done[0].bytes_moved + extra, done[0].seconds)
    folder = store.in_place(prefix)
    assert folder is not None
    return ResumePoint(ck.run, ck.step, str(folder), done)


def _fetch_to_folder(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int], files: list[FileInfo],
                     wide: list[FileInfo], dest: Path, moved: dict[int, int], verify: Verify, actor: str,
                     notes: list[str], *, scratch: bool = False) -> ResumePoint:
    """Wanted parts and wide files assembled in a hidden sibling of ``dest``, renamed into place
    whole; a ``dest`` an earlier resume of this checkpoint filled is taken as it is (checked: its
    manifests are this checkpoint's as registered, its files have their sizes). Anything else in
    ``dest`` is refused, unless it is this node's ``scratch`` resume folder holding no part of this
    checkpoint (a sibling worker's other part is never removed under it): that is redone."""


    if dest.is_dir() and any(dest.iterdir()):
        held = _parts_held(cat, ck, dest)
        found = (set(wanted) <= held
                 and _check_folder(dest, [f for f in files if f.part in wanted] + wide, verify))
        if found:  # an earlier resume of this checkpoint into this folder left it complete
            return ResumePoint(ck.run, ck.step, str(dest), [PartResume(p, 0, IN_PLACE, 0, 0.0) for p in wanted])
        if scratch and not held and not dest.is_symlink():  # this node's own folder, of no part of ck: redone
            shutil.rmtree(dest)
        else:
            ensure_empty_target(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = dest.parent / f".{dest.name}.resume-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    bad: list[BadReplica] = []
    done = []
    try:
        with RestoreStage(dest.parent, buffer_bytes=stores.settings.io_buffer_bytes) as dst, \
                ThreadPoolExecutor(max(1, len(wide)), thread_name_prefix="wide") as side:
            # the checkpoint-wide files (small: an index, DCP's .metadata) come alongside the parts
            beside = [side.submit(_bring_file, cat, stores, ck, f, dst, f"{stage.name}/{f.path}", actor, notes)
                      for f in wide]
            for p in wanted:
                t0 = time.monotonic()
                part_bytes = sum(f.size for f in files if f.part == p)
                try:
                    tier = _fetch_part(cat, stores, ck, p, cat.replicas(ck.id, part=p), dst, stage.name, (0, 1, 2),
                                       _quiet, actor, bad, notes)
                except _PartFailed as exc:
                    raise _NoGoodCopy(str(exc)) from None
                done.append(PartResume(p, 2 if moved[p] else tier, FETCHED, part_bytes + moved[p],
                                       time.monotonic() - t0))
            for fut in beside:
                fut.result()
            publish(stage, dest, pending=dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ResumePoint(ck.run, ck.step, str(dest), done)


def _quiet(_done: int, _label: str) -> None:
    return None


def _parts_held(cat: Catalog, ck: CheckpointInfo, folder: Path) -> set[int]:
    """The parts of ``ck`` whose manifest ``folder`` holds exactly as registered: files of another
    checkpoint of the same model (same names, same sizes) are not this one's."""
    held = set()
    for p in range(ck.parts):
        path = folder / manifest_name(p, ck.parts)
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
                continue
            manifest = Manifest.from_json(path.read_bytes())
        except (OSError, ValueError, CorruptCheckpoint, BadInput):
            continue
        if manifest.digest() == catalog_digest(cat, ck.id, ck.run, ck.step, p, ck.parts, attempt=ck.attempt):
            held.add(p)
    return held


def _check_folder(folder: Path, files: list[FileInfo], verify: Verify) -> bool:
    """Whether ``folder`` holds exactly these files as registered (sizes; CRC32C with ``full``)."""
    for f in files:
        p = folder / f.path
        if not p.is_file() or p.stat().st_size != f.size:
            return False
        if verify == "full" and hash_file(p) != (f.size, f.checksum):
            return False
    return True


def _bring_file(cat: Catalog, stores: TierStores, ck: CheckpointInfo, f: FileInfo, dst: TierStore, key: str,
                actor: str, notes: list[str]) -> int:
    """One checkpoint-wide file of another part put at ``key`` from a good copy of that part
    (checked as it lands); 0 when it is already there and matches. Bytes moved."""
    try:
        dst.verify_object(key, f.size, f.checksum)
        return 0
    except (NotFound, CorruptCheckpoint):
        pass
    if stores.configured(1):  # the node resuming that part may be rehydrating it: read Tier 1 after it
        await_copy(cat, stores.settings, ck, f.part, 1)
    prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
    for src in _sources(cat, stores, ck, f.part):
        store = stores.get(src.tier)
        try:
            with store.open_read(f"{prefix}/{f.path}") as reader:
                dst.put_verified(key, reader, f.size, f.checksum)
            return f.size
        except (CorruptCheckpoint, NotFound) as exc:
            _mark(cat, src.replica, exc, actor, notes)
    raise _NoGoodCopy(f"no good copy of {f.path} (part {f.part})")


__all__ = ["FETCHED", "IN_PLACE", "PartResume", "ResumePoint", "Source", "check_file", "plan_sources", "resume"]
