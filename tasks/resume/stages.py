"""Stage bookkeeping of a fetch into a folder tier: the hidden stage a part lands in
(``staged``, the landing ``tasks.copy.copy_between_tiers`` publishes through), its publish by
one rename (``publish_stage``), and the sweeps of stages a dead fetch left."""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from core.checksum import hash_file
from core.errors import BadInput, ConflictError, NotFound, PathEscape, UnknownRun
from core.layout import ATTEMPT_PATTERN, STAGING_MARK, checkpoint_dirname, checkpoint_prefix, is_staging, staging_name
from core.manifest import Manifest
from core.paths import safe_run_name
from core.storage.base import TierStore
from core.storage.local import fsync_dir
from core.tiers import readable_from
from db.catalog import Catalog
from db.entities import COPYING, CheckpointInfo
from tasks.base import log
from tasks.claim import ClaimedCopy
from tasks.copy import Landing

STAGE_AGE_S = 3600.0  # a resume's stage folder older than this was left by a killed resume


def stage_label(step: int, part: int, parts: int, attempt: str = "") -> str:
    """What a part's fetch stage is named for, after the ``staging_name`` mark: the checkpoint's
    folder name (the attempt's too: ``step-00000100@B``) and the part,
    ``step-00000100@B.part-00000-of-00001``. The stage lies in the run's folder, beside the step's."""
    return f"{checkpoint_dirname(step, attempt)}.part-{part:05d}-of-{parts:05d}"


@contextmanager
def staged(cat: Catalog, dst: TierStore, ck: CheckpointInfo, part: int, held: ClaimedCopy) -> Iterator[Landing]:
    """The landing of a fetch into the folder tier ``dst`` (``tasks.copy.copy_between_tiers``'s
    ``stage``), entered under the part's claim: the stages a dead fetch of this part left are
    removed (the claim proves their writer is gone: a live one would hold it; a stage of another
    attempt's checkpoint at the same step is that one's), the files land in
    a fresh stage ``<run>/.ckpt-staging-<pid>-<id>-<stage_label>`` and the complete stage is
    renamed onto the step's folder (``publish_stage``). A failure removes the stage; a kill
    leaves it to the next claim."""
    _sweep_stages(cat, dst, ck, part, held.actor)
    key = f"{ck.run}/{staging_name(stage_label(ck.step, part, ck.parts, ck.attempt))}"
    landing = _Stage(key, dst.write_path(key), dst.write_path(checkpoint_prefix(ck.run, ck.step, ck.attempt)))
    try:
        yield landing
    finally:
        shutil.rmtree(landing.stage, ignore_errors=True)  # gone already when published


class _Stage:
    """A part's stage: ``key`` on the tier, ``stage`` its folder, published onto ``folder``."""

    def __init__(self, key: str, stage: Path, folder: Path):
        self.key, self.stage, self.folder = key, stage, folder

    def publish(self, manifest: Manifest) -> None:
        publish_stage(self.stage, self.folder, manifest)


def _sweep_stages(cat: Catalog, dst: TierStore, ck: CheckpointInfo, part: int, actor: str) -> int:
    """Remove the stages of ``part`` of ``ck`` in the run's folder on ``dst``: called under the
    part's claim, so each was left by a fetch that died (or lost the claim). Audited; a link is
    removed itself, never followed. Stages of other parts and steps are never touched."""
    label = stage_label(ck.step, part, ck.parts, ck.attempt)
    dead = [e for e, found in _stages(dst, ck.run) if found == (ck.step, part, ck.parts, ck.attempt)]
    return _remove_stages(cat, dst, ck.run, ck.step, part, dead, actor,
                          f"{len(dead)} stage folder(s) of part {part}: left by a resume's fetch that died ({label})")


_STAGE = re.compile(f"^step-(?P<step>\\d{{8,}})(?:@(?P<attempt>{ATTEMPT_PATTERN}))?"
                    r"\.part-(?P<part>\d{5})-of-(?P<parts>\d{5})$", re.ASCII)


def _stages(dst: TierStore, run: str) -> list[tuple[Path, tuple[int, int, int, str]]]:
    """The fetch stages in ``run``'s folder on the folder tier ``dst``, with the (step, part,
    parts, attempt) each is for; an entry of another shape is not a stage and is left alone, and
    a folder whose name is not a run's (``lost+found``) holds none, nor does one that is a link
    (``write_path`` gives the run's folder as it is, never resolved: what lies behind a link is
    another folder's, another run's say)."""
    try:
        folder = dst.write_path(safe_run_name(run)) if dst.in_place() is not None else None
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
            found.append((e, (int(m["step"]), int(m["part"]), int(m["parts"]), m["attempt"] or "")))
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
        by_part: dict[tuple[int, int, int, str], list[Path]] = {}
        for entry, found in stages:
            by_part.setdefault(found, []).append(entry)
        for (step, part, _parts, attempt), entries in sorted(by_part.items()):
            try:
                ck = cat.get_checkpoint(run, step, attempt)
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


def publish_stage(stage: Path, folder: Path, manifest: Manifest) -> None:
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
