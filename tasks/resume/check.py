"""The in-place check: whether a copy still is what the catalog registered (its manifest, each
file's size, and with ``verify="full"`` its CRC32C), and the mark a copy that is not gets."""

from __future__ import annotations

from pathlib import Path

from core.checksum import hash_file
from core.errors import BadInput, CorruptCheckpoint, NotFound
from core.layout import checkpoint_prefix, manifest_name
from core.manifest import MAX_MANIFEST_BYTES, Manifest
from core.storage.base import TierStore, hash_object
from db.catalog import Catalog
from db.entities import CheckpointInfo, FileInfo, ReplicaInfo
from tasks.base import catalog_digest, log, registered_manifest
from tasks.replicas import classify_failure, mark_bad
from tasks.resume.plan import Source, Verify


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


def part_good(cat: Catalog, store: TierStore, ck: CheckpointInfo, src: Source, files: list[FileInfo], verify: Verify,
              actor: str, notes: list[str]) -> bool:
    """Whether the part's copy on ``store`` still matches the registered manifest; marks it if not."""
    part = src.replica.part
    try:
        registered_manifest(cat, store, ck.id, ck.run, ck.step, part, ck.parts, attempt=ck.attempt)
        for f in files:
            if f.part == part:
                check_file(store, f"{checkpoint_prefix(ck.run, ck.step, ck.attempt)}/{f.path}", f, verify)
    except (CorruptCheckpoint, NotFound, FileNotFoundError, BadInput) as exc:
        mark(cat, src.replica, exc, actor, notes)
        return False
    return True


def mark(cat: Catalog, replica: ReplicaInfo, exc: BaseException, actor: str, notes: list[str]) -> None:
    state = classify_failure(exc) or "corrupt"
    bad = mark_bad(cat, replica, state, f"resume: {exc}", actor=actor)
    recorded = "marked in the catalog" if bad.marked else "not marked: its row changed meanwhile"
    log.warning("resume %s/step-%d part %d: tier %d copy is %s (%s; %s); trying the next copy",
                replica.run, replica.step, replica.part, replica.tier, state, exc, recorded)
    notes.append(f"step {replica.step} part {replica.part}: tier {replica.tier} copy is {state} ({exc}); "
                 f"{recorded}, trying the next copy")


def parts_held(cat: Catalog, ck: CheckpointInfo, folder: Path) -> set[int]:
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


def folder_holds(folder: Path, files: list[FileInfo], verify: Verify) -> bool:
    """Whether ``folder`` holds exactly these files as registered (sizes; CRC32C with ``full``)."""
    for f in files:
        p = folder / f.path
        if not p.is_file() or p.stat().st_size != f.size:
            return False
        if verify == "full" and hash_file(p) != (f.size, f.checksum):
            return False
    return True
