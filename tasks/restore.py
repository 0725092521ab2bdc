"""restore: bring a checkpoint back into a local folder from the nearest verified copy.

Contract of ``restore_checkpoint``:
- It picks the newest committed checkpoint of the run (or ``step``) and, part by part, the
  verified replicas readable on this machine, nearest tier first (Tier 0 of this node, Tier 1,
  Tier 2; ``preference`` narrows or reorders that).
- Restoring is a copy into a private staging folder (``core.storage.stage``): every file is
  checked against the manifest the catalog registered as it is fetched; files are fetched in
  parallel (``Settings.copy_parallelism``), from S3 through ``core.transfer.copy_part``.
- A copy whose bytes or manifest do not match becomes ``corrupt`` (absent files: ``missing``)
  in the catalog, and the next copy is tried (files of the failed copy already fetched and
  proven good are kept, so the next copy fetches only the rest); when no copy of the
  checkpoint is good, the previous checkpoint is (only when no step was named, unless
  ``fallback=True``). Every such
  step is said in ``RestoreReport.notes``. A copy that cannot be reached (a transient error,
  or a tier whose root does not prove its identity: a mount that is gone) is no verdict: the
  next copy is tried. A transient failure of every copy of a part raises (retry later) instead
  of falling back to older state.
- ``dest`` must be absent or an empty folder. The checkpoint is assembled in a hidden sibling
  folder and renamed into place in one step, so ``dest`` is either untouched or complete;
  the staging folder is removed whatever happens.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from core import transfer
from core.errors import ConflictError, NotFound, StorageUnavailable, is_transient
from core.layout import checkpoint_prefix
from core.paths import safe_run_name
from core.settings import Settings
from core.storage.stage import RestoreStage, fetch_local_part, publish
from db.catalog import Catalog
from db.entities import CKPT_COMMITTED, CKPT_RETIRED, CKPT_SUPERSEDED, CheckpointInfo, ReplicaInfo
from tasks.base import catalog_manifest, log, open_catalog, registered_manifest
from tasks.replicas import DEFAULT_PREFERENCE, BadReplica, TierStores, classify_failure, mark_bad, verified_sources
from tasks.retry import pipeline_task

# progress(done_bytes, total_bytes, label): the position in the checkpoint being restored; it
# goes back when a copy fails and the next one is tried. Called from the copy's threads.
Progress = Callable[[int, int, str], None]


def _no_progress(_done: int, _total: int, _label: str) -> None:
    return None


@dataclass
class RestoreReport:
    """What a restore did: the checkpoint and tiers it used, and every fallback on the way."""

    run: str
    step: int
    dest: str
    tiers: list[int]  # tier that completed each part, part order
    bytes: int
    files: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    bad: list[BadReplica] = field(default_factory=list)
    fell_back_from: int | None = None  # the newer step that could not be restored

    @property
    def tier(self) -> int:
        """The farthest tier used (the one that bounded the restore)."""
        return max(self.tiers)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        tiers = ", ".join(f"tier {t}" for t in sorted(set(self.tiers)))
        return (f"restored {self.run}/step-{self.step} from {tiers} into {self.dest}: "
                f"{self.files} files, {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s "
                f"({self.mb_per_s:.0f} MB/s)")


class PartFailed(Exception):
    """No readable copy of a part was good; ``transient`` when some failure may pass."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


def restore_checkpoint(settings: Settings, run: str, dest: str | os.PathLike, *, step: int | None = None,
                       preference: Sequence[int] = DEFAULT_PREFERENCE, fallback: bool | None = None,
                       progress: Progress = _no_progress, actor: str = "cli",
                       attempt: str | None = None) -> RestoreReport:
    """Restore ``run`` (newest, or ``step``) into ``dest``; see the module contract."""
    safe_run_name(run)
    target = Path(dest).expanduser().absolute()
    ensure_empty_target(target)
    fallback = (step is None) if fallback is None else fallback
    started = time.monotonic()
    notes: list[str] = []
    bad: list[BadReplica] = []
    first_step: int | None = None
    with open_catalog(settings.catalog_url) as cat, TierStores(settings) as stores:
        cat.get_run(run)
        for ck in candidates(cat, run, step, fallback, attempt):
            first_step = ck.step if first_step is None else first_step
            try:
                tiers = _restore_one(cat, stores, ck, target, preference, progress, actor, bad, notes)
            except PartFailed as exc:
                if exc.transient:
                    raise StorageUnavailable(f"{run}/step-{ck.step}: {exc}; not falling back to an "
                                             "older checkpoint while a copy may only be unreachable") from None
                notes.append(f"step {ck.step}: {exc}")
                if fallback:
                    log.warning("restore %s: step %d has no good copy (%s); trying the previous checkpoint",
                                run, ck.step, exc)
                continue
            report = RestoreReport(run=run, step=ck.step, dest=str(target), tiers=tiers,
                                   bytes=ck.total_bytes, files=ck.file_count,
                                   seconds=time.monotonic() - started, notes=notes, bad=bad,
                                   fell_back_from=first_step if first_step != ck.step else None)
            if report.fell_back_from is not None:
                notes.append(f"fell back from step {first_step} to step {ck.step}")
            log.info("%s", report.summary())
            return report
    what = f"step {step}" if step is not None else "any checkpoint"
    raise NotFound(f"{run}: no good copy of {what} is readable here"
                   + (f" ({'; '.join(notes)})" if notes else ""))


def candidates(cat: Catalog, run: str, step: int | None, fallback: bool,
               attempt: str | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints to try, newest first: ``step`` (then older ones with ``fallback``),
    or every committed checkpoint of the run. A superseded checkpoint is offered only when its
    step and ``attempt`` are named (and then alone)."""
    if step is not None:
        named = cat.get_checkpoint(run, step, attempt)
        if named.state == CKPT_RETIRED:
            raise NotFound(f"{run}/step-{step} was retired by the retention policy: it is no longer offered "
                           "for restore (see `ckpt history`)")
        if named.state == CKPT_SUPERSEDED:
            if attempt is None:
                raise NotFound(f"{run}/step-{step} of attempt {named.attempt or '(unnamed)'} was superseded by attempt "
                               f"{named.superseded_by or '(unnamed)'}, which resumed from below it; it is no longer "
                               f"offered (name it with --attempt {named.attempt} to restore it anyway)")
            return [named]
        if not fallback:
            return [named]
    found = [c for c in cat.list_checkpoints(run) if c.state == CKPT_COMMITTED
             and (step is None or c.step <= step)]
    return sorted(found, key=lambda c: c.step, reverse=True)


def ensure_empty_target(target: Path) -> None:
    """``target`` must be absent or an empty folder (a restore never merges or overwrites)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ConflictError(f"{target} exists and is not a folder; choose another destination")
    if target.is_dir() and any(target.iterdir()):
        raise ConflictError(f"{target} is not empty; restore into a new or empty folder")


def _restore_one(cat: Catalog, stores: TierStores, ck: CheckpointInfo, target: Path, preference: Sequence[int],
                 progress: Progress, actor: str, bad: list[BadReplica], notes: list[str]) -> list[int]:
    """Fetch every part of ``ck`` into a staging sibling of ``target``, then publish it."""
    replicas = cat.replicas(ck.id)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = target.parent / f".{target.name}.restore-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        with RestoreStage(target.parent, buffer_bytes=stores.settings.io_buffer_bytes) as dst:
            tiers = _fetch_parts(cat, stores, ck, replicas, dst, stage.name, preference, progress, actor, bad, notes)
            publish(stage, target, pending=dst)
        return tiers
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _fetch_parts(cat: Catalog, stores: TierStores, ck: CheckpointInfo, replicas: list[ReplicaInfo], dst: RestoreStage,
                 dst_prefix: str, preference: Sequence[int], progress: Progress, actor: str,
                 bad: list[BadReplica], notes: list[str]) -> list[int]:
    """Every part in turn, nearest good copy first; the tier each came from."""
    part_bytes = [sum(f.size for f in cat.files(ck.id, part)) for part in range(ck.parts)]
    tiers = []
    for part in range(ck.parts):
        at = partial(_position, progress, sum(part_bytes[:part]), ck.total_bytes)
        tiers.append(fetch_part(cat, stores, ck, part, replicas, dst, dst_prefix, preference, at,
                                actor, bad, notes))
    return tiers


def fetch_part(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int, replicas: list[ReplicaInfo],
               dst: Any, dst_prefix: str, preference: Sequence[int], progress: Callable[[int, str], None], actor: str,
               bad: list[BadReplica], notes: list[str]) -> int:
    """Copy one part from its nearest good replica into ``dst`` under ``dst_prefix``; return the
    tier it came from; ``PartFailed`` when no copy was good. Shared by restore and a resume's
    fetch into a folder (``tasks.resume.folder``)."""

    settings = stores.settings
    sources = verified_sources(replicas, part, settings, preference)
    if not sources:
        states = ", ".join(f"tier {r.tier}: {r.state}" for r in replicas if r.part == part) or "none recorded"
        raise PartFailed(f"part {part} has no verified copy readable here ({states})", transient=False)
    transient = False
    for rep in sources:
        label = f"step {ck.step} part {part} from tier {rep.tier}"
        progress(0, label)
        try:  # a tier whose root is unproven (``TierUnavailable``) is unreachable: the next copy is tried
            src = stores.get(rep.tier)
            prefix, report = checkpoint_prefix(ck.run, ck.step, ck.attempt), (lambda done: progress(done, label))
            if src.in_place(prefix) is not None:  # a folder here: copy in the kernel
                manifest = registered_manifest(cat, src, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt)
                fetch_local_part(src, prefix, dst, dst_prefix, manifest, parallelism=fetch_streams(settings, True),
                                 progress=report)
            else:  # object storage: one stream per object, as many as the S3 settings allow; the
                # tier's manifest is read (one round trip on S3) while the files stream
                with ThreadPoolExecutor(1, thread_name_prefix="manifest") as side:
                    found = side.submit(registered_manifest, cat, src, ck.id, ck.run, ck.step, part, ck.parts,
                                        attempt=ck.attempt)
                    transfer.copy_part(src, prefix, dst, dst_prefix,
                              catalog_manifest(cat, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt),
                              parallelism=fetch_streams(settings, False),
                              progress=report, confirm=found.result)
            return rep.tier
        except Exception as exc:  # classified below; the rest propagates
            state = classify_failure(exc)
            if state is None and not is_transient(exc):
                raise
            why = str(exc).replace(f"{dst_prefix}/", "")  # name files as the checkpoint does
            if state is None:
                transient = True
                notes.append(f"step {ck.step} part {part}: tier {rep.tier} unreachable ({why}); trying the next copy")
                continue
            bad.append(mark_bad(cat, rep, state, f"restore: {why}", actor=actor))
            notes.append(f"step {ck.step} part {part}: tier {rep.tier} copy is {state} ({why}); "
                         "marked in the catalog, trying the next copy")
    raise PartFailed(f"every copy of part {part} failed", transient=transient)


def fetch_streams(settings: Settings, local: bool) -> int:
    """Files a fetch of one part reads at once: ``copy_parallelism`` from a local folder; from
    object storage at least ``s3_max_concurrency`` (one stream per small object, as many as the
    S3 settings allow; a large object's ranged GETs share the store's own pool)."""
    return settings.copy_parallelism if local else max(settings.copy_parallelism, settings.s3_max_concurrency)


def _position(progress: Progress, base: int, total: int, done: int, label: str) -> None:
    progress(base + done, total, label)


restore_task = pipeline_task(restore_checkpoint, name="restore-checkpoint")
