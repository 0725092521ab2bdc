"""The training-side client: commit a checkpoint on Tier 0, announce it, get back to training.

``CheckpointStager(run).save(step, tensors)`` writes safetensors shards into a staging folder
on Tier 0 (each tensor hashed once, CRC32C, the shards' CRCs combined from the tensors'),
writes the manifest last, renames the folder to ``<tier0>/<run>/step-XXXXXXXX/`` and
returns. Everything slower than that local commit happens elsewhere: the
``ckpt.checkpoint.completed`` event is sent from a background thread (retried; a failure is
logged, never raised into training, and the node agent's reconcile promotes what an event
missed); Tier 1 and Tier 2 are the promote flow's business.

The writer's stall (the seconds ``save`` kept the training loop waiting) is measured and
recorded in the manifest (``writer_stall_seconds``), so the catalog can report each run's
real ΔMFU (see ``core.sizing``). With ``background=True`` the stall is only the copy of the
tensors to host memory; the shards are written by a writer thread, in order.

Before a save of tensors writes (and before a trainer integration's library writes:
``ensure_room``), Tier 0 must have room for it (``ckpt.space``): else this node's Tier 0
retention is asked for room and waited for, then ``StorageFull`` is raised with nothing
written. Background writes still queued count as taken (whole, until they finish).

A run's origin (``resumed_from=``, ``fine_tuned_from=`` or ``branched_from=``: the checkpoint
it started from) is written into every manifest the stager commits, so the catalog learns it
from whichever checkpoint it registers, even when the job never reached the catalog itself;
the announcer also registers the run with it at once, so the origin is protected from
retirement before the run's first checkpoint is promoted.

Multi-node jobs: each node creates its stager with its ``part`` and ``parts`` (and its node
label, default ``settings.node``); a part's files live under ``part-0000p/`` so that every
part can sit in one checkpoint folder on Tier 1.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypedDict, overload

from ckpt.announce import Announcer, RunRegistration
from ckpt.space import Tier0Space, state_needed
from core import checksum
from core.attempt import launch_attempt
from core.errors import BadInput, CkptError, ConflictError, StorageFull, TierUnavailable
from core.formats import detect_format
from core.layout import checkpoint_dirname, manifest_name, parse_checkpoint_dirname, staging_name
from core.manifest import ORIGIN_RELATIONS, FileEntry, Manifest, ParentRef, utcnow_iso
from core.manifest_build import build_manifest, write_manifest
from core.paths import safe_run_name
from core.policy import checkpoint_kind
from core.settings import Settings, load_settings
from core.space import Reading, free_bytes
from core.storage.identity import MARKER_KEY
from core.storage.local import fsync_dir

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class SavedCheckpoint:
    """A part committed on Tier 0."""

    run: str
    step: int
    part: int
    parts: int
    path: Path  # the checkpoint folder on Tier 0
    manifest: Manifest
    stall_seconds: float


@dataclass
class PendingSave:
    """A background save: ``stall_seconds`` is what training waited (the snapshot);
    ``result()`` waits for the commit on Tier 0 and raises its error, if any."""

    step: int
    stall_seconds: float
    future: Future = field(repr=False)

    def result(self, timeout: float | None = None) -> SavedCheckpoint:
        return self.future.result(timeout)


def tier0_root(settings: Settings) -> Path:
    """Tier 0 must be a local folder: the training process writes it directly."""
    url = settings.tier0_url or ""
    url = url.removeprefix("file://")
    if "://" in url:
        raise BadInput(f"Tier 0 must be a local folder, got {settings.tier0_url!r}")
    return Path(url).expanduser().absolute()


class CheckpointStager:
    """Commit checkpoints of one run (one part of it) on Tier 0 and announce them.

    Use as a context manager, or call ``close()`` at the end: it waits for background writes
    and gives pending events a few seconds to leave.

    A fine-tune's frozen base is stored once on the shared tiers when its tensors sit in shard
    files of their own, the same files at every save. The stager finds them itself: the
    tensors whose bytes (CRC32C), dtype and shape equal its previous save's are written first,
    apart from the others; a tensor that changes again goes back among them at that save.
    Which saves dedupe: found, from the second save of a run on, and from the first save after
    a restart when Tier 0 still holds the run's newest checkpoint (its shards' checksums are
    compared with the current tensors'); named with ``frozen=`` (a fine-tune's base, known
    before training), from the first. Once a save finds no unchanged tensor (a pretraining
    run), the next ones hash their tensors as they write them, as a save always did, and
    compare after: a tensor that stops changing then is kept apart one save later.

    The layout only decides which files can be shared: every file is written whole and
    checksummed, and the tiers compare bytes before sharing, so a tensor taken for unchanged
    by mistake (a CRC32C collision) costs sharing, never bytes.
    """

    def __init__(self, run: str, *, settings: Settings | None = None,
                 resumed_from: tuple[str, int] | None = None,
                 fine_tuned_from: tuple[str, int] | None = None,
                 branched_from: tuple[str, int] | None = None,
                 part: int = 0, parts: int = 1, node: str | None = None, project: str | None = None,
                 background: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 fsync: bool = True, announce: bool = True, measure_stall: bool = True,
                 attempt: str | None = None, frozen: Collection[str] = ()):
        self.origin = run_origin(resumed_from=resumed_from, fine_tuned_from=fine_tuned_from,
                                 branched_from=branched_from)
        if not 0 <= part < parts:
            raise BadInput(f"invalid part {part} of {parts}")
        self.run = safe_run_name(run)
        # the node names its Tier 0 folder too (embedded default: <data_dir>/tier0/<node>)
        self.settings = settings or load_settings(**({"node": node} if node else {}))
        self.part, self.parts = part, parts
        self.attempt = launch_attempt(attempt)  # which launch of the job this is (core.attempt)
        self.node = node or self.settings.node
        self.root = tier0_root(self.settings)
        self.shard_bytes = shard_bytes
        # tensors the run does not train (a fine-tune's base): shards of their own, so the same
        # bytes give the same files and the shared tiers hold them once (core.storage.content);
        # from the second save on, also those that did not change since the previous one
        self.frozen = frozenset(frozen)
        self._previous: _Previous | None = None  # None before the first save (then Tier 0 tells)
        self.fsync = fsync
        self.background = background
        self.measure_stall = measure_stall  # False for ``ckpt watch``: it cannot see the job's stall
        o = self.origin
        reg = RunRegistration(self.run, project, (o.run, o.step) if o else None, o.relation if o else "resumed_from",
                              attempt=self.attempt)
        self._announcer = Announcer(self.settings, reg, enabled=announce)
        self._announcer.submit(("register",))
        self._writer = _Writer() if background else None
        self.space = Tier0Space(self.settings, self.root, on_low=self._announce_low)

    # --- the training loop's calls -------------------------------------------------------
    @overload
    def save(self, step: int, tensors_or_folder: str | os.PathLike, *,
             metrics: Mapping[str, float] | None = None, milestone: bool = False,
             epoch_end: bool = False, parent: tuple[str, int] | None = None,
             stall_seconds: float | None = None) -> SavedCheckpoint: ...

    @overload
    def save(self, step: int, tensors_or_folder: Mapping[str, object], *,
             metrics: Mapping[str, float] | None = None, milestone: bool = False,
             epoch_end: bool = False, parent: tuple[str, int] | None = None,
             stall_seconds: float | None = None) -> SavedCheckpoint | PendingSave: ...

    def save(self, step: int, tensors_or_folder: Mapping[str, object] | str | os.PathLike, *,
             metrics: Mapping[str, float] | None = None, milestone: bool = False,
             epoch_end: bool = False, parent: tuple[str, int] | None = None,
             stall_seconds: float | None = None) -> SavedCheckpoint | PendingSave:
        """Commit ``step`` on Tier 0: a dict of arrays (written as safetensors shards) or the
        path of a folder a framework already wrote (DCP, HF), which is adopted by rename.
        Returns once the part is committed locally (background mode: once it is snapshotted).
        ``stall_seconds``: for an adopted folder, the stall the caller measured itself (a trainer
        integration, whose library's own save came before this call, or an async save committed
        from another thread); by default the time this call took."""
        from core import safetensors_writer as stw  # deferred: start-up — numpy, a large share of the client's import

        t0 = time.perf_counter()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise BadInput(f"step must be a non-negative int, got {step!r}")
        # every manifest carries the run's origin (an explicit ``parent`` names this save's own):
        # the catalog learns it from whichever part it registers, announced or not
        parent_ref = ParentRef(parent[0], int(parent[1]), "resumed_from") if parent else self.origin
        meta: dict[str, Any] = dict(step=step, metrics=dict(metrics or {}), parent=parent_ref,
                    kind=checkpoint_kind(step, milestone=milestone, epoch_end=epoch_end,
                                         policy=self.settings.milestones))
        self._raise_background_error()
        self.prove_root()
        if isinstance(tensors_or_folder, (str, os.PathLike)):
            return self._commit(Path(tensors_or_folder), None, t0, stall=stall_seconds, **meta)
        needed = state_needed(tensors_or_folder)
        if self._writer is None:
            self.space.ensure_room(self.run, step, needed)
            arrays = {k: stw.as_host_array(v) for k, v in tensors_or_folder.items()}
            return self._commit(None, arrays, t0, **meta)
        self.space.ensure_room(self.run, step, needed, pending=self._writer.pending_bytes)
        arrays = stw.snapshot(tensors_or_folder, reuse=self._writer.take_buffers())
        stall = time.perf_counter() - t0
        fut = self._writer.submit(lambda: self._commit(None, arrays, None, stall=stall, **meta), buffers=arrays,
                                  nbytes=needed)
        return PendingSave(step, stall, fut)

    def ensure_room(self, step: int, nbytes: int) -> None:
        """Check, before a library writes ``nbytes`` of ``step`` into Tier 0 itself (a trainer
        integration: DCP, the HF Trainer, Lightning), that they fit: this node's Tier 0
        retention runs and is waited for when they do not (``settings.tier0_space_wait_seconds``),
        then ``StorageFull``. ``save`` of tensors checks by itself."""
        self.prove_root()
        self.space.ensure_room(self.run, step, nbytes, pending=self._writer.pending_bytes if self._writer else 0)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every background write; raise the first error one of them hit."""
        if self._writer:
            self._writer.drain(timeout)
            self._raise_background_error()

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` for background writes, then up to ``timeout`` for the events
        still queued. A job that saves and exits at once must not lose its event to the
        announcer's first import of the catalog and HTTP libraries (seconds on a busy node):
        an event that never leaves is promoted only by the next reconcile, a minute or more
        later."""
        try:
            self.wait(timeout)
        finally:
            if self._writer:
                self._writer.stop()
            self._announcer.close(timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the commit -------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.root / self.run / checkpoint_dirname(step, self.attempt)

    def _announce_low(self, reading: Reading, run: str, step: int) -> None:
        self._announcer.submit(("tier_low", reading, run, step, self.part, self.parts, self.node))

    def prove_root(self) -> None:
        """Tier 0's root shows its identity marker (``core.storage.identity``: written by the
        agent's start or ``ckpt tiers init``) before anything is written under it: an NVMe that
        is not mounted shows an empty folder on the root disk, and a save there would be hidden
        when the mount comes back. A missing root is never created, except the embedded default
        folder (``Settings.embedded_root``), which the agent's first use marks. One ``stat`` a
        save: a mount lost mid-job is seen at the next save."""
        if (self.root / MARKER_KEY).is_file():
            return
        if self.settings.embedded_root(0) == self.root:
            self.root.mkdir(parents=True, exist_ok=True)
            return
        reason = ("its root does not exist (not mounted?); a save never creates it" if not self.root.is_dir() else
                  "its root shows no tier identity marker: not mounted, or never set up (start this node's agent, "
                  "or run `ckpt tiers init` on it)")
        raise TierUnavailable(0, str(self.root), reason)

    def _raise_background_error(self) -> None:
        if self._writer and self._writer.error is not None:
            err, self._writer.error = self._writer.error, None
            raise err
        if self._announcer.registration.refused:  # the catalog refuses every save of this layout or attempt
            raise ConflictError(self._announcer.registration.refused)

    def _commit(self, folder: Path | None, arrays: Mapping[str, tuple[np.ndarray, str]] | None, t0: float | None,
                *, step: int, stall: float | None = None, **meta: Any) -> SavedCheckpoint:
        from core import safetensors_writer as stw  # deferred: start-up — numpy, a large share of the client's import

        final = self.checkpoint_dir(step)
        final.parent.mkdir(parents=True, exist_ok=True)
        prefix = f"part-{self.part:05d}/" if self.parts > 1 else ""
        if arrays is None:
            assert folder is not None  # an adopted folder, no tensors
            folder = folder.expanduser().absolute()
            manifest = self._manifest(folder, None, t0, stall, step=step, **meta)
            if folder != final:
                publish_folder(folder, final, manifest)
        else:
            staging = final.parent / staging_name(final.name)
            # Which tensors did not change since the previous save decides the layout, so their CRCs
            # come first where that can matter: at the first comparison (the second save, or the
            # first after a restart, against Tier 0) and while the last one found unchanged tensors.
            # Else (a pretraining run) they are hashed as written, as before, and compared after.
            crcs: dict[str, int] = {}
            prev, learned = self._previous, None
            if prev is None:
                if (newest := self._newest_on_tier0(step)) is not None:
                    crcs = self._tensor_crcs(arrays)
                    learned = stw.unchanged_files(*newest, arrays, crcs)
                apart = self.frozen | (learned or set())
            elif prev.look:
                crcs = self._tensor_crcs(arrays)
                seen = _signatures(arrays, crcs)
                same = (prev.step, prev.seen) == (step, seen)  # the same save again: the same files
                apart = prev.apart if same else self.frozen | {n for n, sig in seen.items() if prev.seen.get(n) == sig}
            else:
                apart = self.frozen
            try:
                written = stw.write_sharded(staging, arrays, shard_bytes=self.shard_bytes, prefix=prefix,
                                            buffer_bytes=self.settings.io_buffer_bytes, fsync=self.fsync,
                                            apart=apart, crcs=crcs)
                files = tuple(FileEntry(w.path, w.size, w.checksum) for w in written)
                manifest = self._manifest(staging, files, t0, stall, step=step, **meta)
                publish_folder(staging, final, manifest)
                seen = _signatures(arrays, crcs)
                look = prev is None or any(prev.seen.get(n) == sig for n, sig in seen.items())
                self._previous = _Previous(step, seen, frozenset(apart), look)
            except OSError as exc:  # room taken since the check (another writer): nothing published
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise StorageFull(f"Tier 0 at {self.root} ran out of space writing {self.run} step {step} "
                                  f"(taken by another writer since the check?): {exc}; nothing was published",
                                  free=free_bytes(self.root)) from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone already unless something failed
        if self.fsync:
            fsync_dir(final.parent)
        self._announcer.submit(("emit", manifest))
        return SavedCheckpoint(self.run, step, self.part, self.parts, final, manifest,
                               manifest.writer_stall_seconds or 0.0)

    def _tensor_crcs(self, arrays: Mapping[str, tuple[np.ndarray, str]]) -> dict[str, int]:
        from core import safetensors_writer as stw  # deferred: start-up — numpy

        return stw.tensor_crcs(arrays, buffer_bytes=self.settings.io_buffer_bytes,
                               threads=self.settings.copy_parallelism)

    def _newest_on_tier0(self, step: int) -> tuple[Path, list[tuple[str, int, str]]] | None:
        """The folder and files of the newest checkpoint of this run and part on Tier 0 (of
        another step): what the first save after a restart compares with (``unchanged_files``:
        its shards' headers are read, not their tensors), so it finds a fine-tune's base as a
        second save does."""
        try:
            names = os.listdir(self.root / self.run)
        except OSError:
            return None
        steps = ((p[0], n) for n in names if (p := parse_checkpoint_dirname(n)) and p[0] != step)
        for _, name in sorted(steps, reverse=True):
            folder = self.root / self.run / name
            try:
                manifest = Manifest.from_json((folder / manifest_name(self.part, self.parts)).read_bytes())
            except (OSError, CkptError):
                continue  # not this part's, or going (Tier 0 retention): an older one
            return folder, [(f.path, f.size, f.checksum) for f in manifest.files]
        return None

    def _manifest(self, folder: Path, files: tuple[FileEntry, ...] | None, t0: float | None, stall: float | None,
                  *, step: int, metrics: dict[str, float], parent: ParentRef | None, kind: str) -> Manifest:
        """Commit the part's manifest inside ``folder``. ``files`` None: an adopted folder,
        described (hashed) and validated by its format here."""
        common: dict[str, Any] = dict(part=self.part, parts=self.parts, node=self.node, kind=kind, metrics=metrics,
                                      parent=parent, attempt=self.attempt)
        if files is None:
            manifest = build_manifest(folder, self.run, step, parallelism=self.settings.copy_parallelism,
                                      buffer_bytes=self.settings.io_buffer_bytes, **common)
        else:
            manifest = Manifest(run=self.run, step=step, files=files, format=detect_format([f.path for f in files]),
                                created_at=utcnow_iso(), **common)
        if stall is None:
            assert t0 is not None  # a save timed here
            stall = time.perf_counter() - t0  # the manifest write and rename that follow are ~ms
        manifest = replace(manifest, writer_stall_seconds=round(stall, 6) if self.measure_stall else None)
        manifest.validate()
        write_manifest(folder, manifest)
        return manifest


Signature = tuple[int, str, tuple[int, ...], int]  # a tensor's (crc32c, dtype, shape, nbytes)


@dataclass(frozen=True)
class _Previous:
    """A stager's previous save: what the next one compares its tensors with."""

    step: int
    seen: dict[str, Signature]
    apart: frozenset[str]  # the tensors it wrote in shards of their own
    look: bool  # hash the next save's tensors first: a comparison may find unchanged ones


def _signatures(arrays: Mapping[str, tuple[np.ndarray, str]], crcs: Mapping[str, int]) -> dict[str, Signature]:
    return {n: (crcs[n], st, a.shape, a.nbytes) for n, (a, st) in arrays.items()}


class OriginKeywords(TypedDict, total=False):
    """The stager's origin keyword as a value (``ckpt watch``, ``ckpt commit``): at most one."""

    resumed_from: tuple[str, int]
    fine_tuned_from: tuple[str, int]
    branched_from: tuple[str, int]


def run_origin(**given: tuple[str, int] | None) -> ParentRef | None:
    """The one origin among ``resumed_from``/``fine_tuned_from``/``branched_from`` (as keywords,
    each ``(run, step)`` or None), as the manifests carry it; ``BadInput`` when several are given."""
    named = [(relation, ref) for relation, ref in given.items() if ref]
    if len(named) > 1:
        raise BadInput(f"give one origin, not {' and '.join(r for r, _ in named)}")
    if not named:
        return None
    relation, (run, step) = named[0]
    if relation not in ORIGIN_RELATIONS:
        raise BadInput(f"unknown origin relation {relation!r}; expected one of {ORIGIN_RELATIONS}")
    return ParentRef(safe_run_name(run), int(step), relation)


# --- publishing ------------------------------------------------------------------------------
def publish_folder(staging: Path, final: Path, manifest: Manifest) -> None:
    """Move a committed part into ``final``: one rename when ``final`` is new; else file by
    file (another part, or the same part saved again), manifest last. The same bytes again
    are a no-op; different bytes for an existing file raise ``ConflictError``."""
    try:
        os.rename(staging, final)
        return
    except OSError:
        if not final.is_dir():
            raise
    for f in manifest.files:
        src, dst = staging / f.path, final / f.path
        if dst.exists():
            if checksum.hash_file(dst) != (f.size, f.checksum):
                raise ConflictError(f"{final}/{f.path} exists with different bytes; not overwritten")
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dst)
    mdst = final / manifest.name
    if not mdst.exists():
        os.replace(staging / manifest.name, mdst)
    elif Manifest.from_json(mdst.read_bytes()).digest() != manifest.digest():
        raise ConflictError(f"{mdst} exists for a different checkpoint; not overwritten")
    shutil.rmtree(staging, ignore_errors=True)


# --- background threads -------------------------------------------------------------------------
class _Writer:
    """One thread that commits snapshotted checkpoints in order, and hands the snapshot
    buffers of finished writes back for the next snapshot (at most ``SPARE_SETS`` kept)."""

    SPARE_SETS = 1

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.pending_bytes = 0  # of writes queued or running: not on disk yet, already promised
        self._q: queue.Queue = queue.Queue()
        self._spare: list = []
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._loop, name="ckpt-writer", daemon=True)
        self._t.start()

    def submit(self, fn: Callable[[], SavedCheckpoint], buffers: Any = None, nbytes: int = 0) -> Future:
        fut: Future = Future()
        with self._lock:
            self.pending_bytes += nbytes
        self._q.put((fn, fut, buffers, nbytes))
        return fut

    def take_buffers(self):
        with self._lock:
            return self._spare.pop() if self._spare else None

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            fn, fut, buffers, nbytes = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait()/result()
                log.error("background checkpoint write failed: %s", exc)
                self.error = self.error or exc
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self.pending_bytes -= nbytes
                    if buffers is not None and len(self._spare) < self.SPARE_SETS:
                        self._spare.append(buffers)
                self._q.task_done()

    def drain(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("background checkpoint writes still running")
            time.sleep(0.01)

    def stop(self) -> None:
        self._q.put(None)
        self._t.join(timeout=5)
