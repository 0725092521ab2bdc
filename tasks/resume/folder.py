"""Source: fetched into a folder (``to``, or this node's resume folder when another node holds the
part's Tier 0 copy): assembled in a hidden sibling and renamed into place whole, as a restore is
(``tasks.restore.fetch_part``); the resume folders of older steps tidied after."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from core.errors import StorageUnavailable
from core.layout import parse_step_dirname
from core.paths import safe_run_name
from core.settings import Settings
from core.storage.stage import RestoreStage, publish
from core.tiers import ALL_TIERS
from db.catalog import Catalog
from db.entities import CheckpointInfo, FileInfo
from tasks.base import log
from tasks.replicas import BadReplica, TierStores
from tasks.restore import PartFailed, ensure_empty_target, fetch_part
from tasks.resume.check import folder_holds, parts_held
from tasks.resume.fetch import bring_file
from tasks.resume.plan import FETCHED, IN_PLACE, NoGoodCopy, PartResume, ResumePoint, Verify
from tasks.resume.stages import STAGE_AGE_S


def fetch_to_folder(cat: Catalog, stores: TierStores, ck: CheckpointInfo, wanted: list[int], files: list[FileInfo],
                    wide: list[FileInfo], dest: Path, moved: dict[int, int], verify: Verify, actor: str,
                    notes: list[str], *, scratch: bool = False) -> ResumePoint:
    """Wanted parts and wide files assembled in a hidden sibling of ``dest``, renamed into place
    whole; a ``dest`` an earlier resume of this checkpoint filled is taken as it is (checked: its
    manifests are this checkpoint's as registered, its files have their sizes). Anything else in
    ``dest`` is refused, unless it is this node's ``scratch`` resume folder holding no part of this
    checkpoint (a sibling worker's other part is never removed under it): that is redone."""
    if dest.is_dir() and any(dest.iterdir()):
        found = folder_filled(cat, ck, wanted, files, wide, dest, verify)
        if found is not None:  # an earlier resume of this checkpoint into this folder left it complete
            return found
        held = parts_held(cat, ck, dest)
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
            beside = [side.submit(bring_file, cat, stores, ck, f, dst, f"{stage.name}/{f.path}", actor, notes)
                      for f in wide]
            for p in wanted:
                t0 = time.monotonic()
                part_bytes = sum(f.size for f in files if f.part == p)
                try:
                    tier = fetch_part(cat, stores, ck, p, cat.replicas(ck.id, part=p), dst, stage.name, ALL_TIERS,
                                      _quiet, actor, bad, notes)
                except PartFailed as exc:
                    if exc.transient:  # a copy that may come back (a mount gone, S3 down): never a reason
                        # to fall back, which would supersede this step for good; the caller retries
                        raise StorageUnavailable(f"{ck.run} step {ck.step} part {p}: {exc}; not falling back "
                                                 "to an older checkpoint while a copy may come back") from None
                    raise NoGoodCopy(str(exc)) from None
                done.append(PartResume(p, 2 if moved[p] else tier, FETCHED, part_bytes + moved[p],
                                       time.monotonic() - t0))
            for fut in beside:
                fut.result()
            publish(stage, dest, pending=dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ResumePoint(ck.run, ck.step, str(dest), done)


def folder_filled(cat: Catalog, ck: CheckpointInfo, wanted: list[int], files: list[FileInfo],
                  wide: list[FileInfo], dest: Path, verify: Verify) -> ResumePoint | None:
    """``dest`` as a resume point when an earlier resume (a sibling rank's, say) filled it with
    the wanted parts of ``ck``: their manifests as registered, every file of its size (and
    CRC32C with ``full``); else None."""
    if dest.is_symlink() or not dest.is_dir() or not set(wanted) <= parts_held(cat, ck, dest):
        return None
    if not folder_holds(dest, [f for f in files if f.part in wanted] + wide, verify):
        return None
    return ResumePoint(ck.run, ck.step, str(dest), [PartResume(p, 0, IN_PLACE, 0, 0.0) for p in wanted])


def _quiet(_done: int, _label: str) -> None:
    return None


def resume_root(settings: Settings, run: str) -> Path:
    """This node's scratch folder for ``run``'s checkpoints fetched beside Tier 0."""
    return settings.data_dir.expanduser().absolute() / "resume" / safe_run_name(run)


@contextmanager
def node_turn(settings: Settings, run: str, target: Path | None = None) -> Iterator[bool]:
    """This node's turn to fetch ``run`` (into ``target``, or its Tier 0 and resume folder):
    the ranks of one node resuming at once take turns, so the first fetches the checkpoint and
    each of the others then finds it in place (never a second fetch into the same folder, nor a
    half-fetched one). An exclusive ``flock`` on a file under ``<data_dir>/resume/`` keyed by the
    node, the run and ``target``: the kernel lets go of it when its holder exits, killed or not,
    so a rank killed mid-fetch holds up no other (the fetch it left is a stage, or a claim that
    lapses as any claimed copy's does). Not a catalog claim: the turn guards this node's own
    folders, which the catalog does not record. Yields whether it waited for another's turn."""
    base = settings.data_dir.expanduser().absolute() / "resume"
    base.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\0".join((settings.node, safe_run_name(run), str(target or ""))).encode()).hexdigest()
    fd = os.open(base / f".turn-{key[:16]}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            log.info("resume %s: another rank of this node is fetching it; waiting for its turn to end", run)
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = True
        yield waited
    finally:
        os.close(fd)  # lets go of the lock


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
