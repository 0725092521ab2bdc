"""Build, write and read manifests (the commit marker of a checkpoint part).

``build_manifest`` makes the manifest of a local checkpoint folder: one streaming CRC32C
pass per file in a thread pool (crc32c releases the GIL, so threads scale with the disks),
format detected from the names and validated from the bytes. ``write_manifest`` publishes
it atomically and durably (tmp + fsync + link/rename + fsync dir) once every file is in
place; until then the folder is not a checkpoint. ``read_manifest`` reads one back from any
tier.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO

from core import checksum, formats
from core.errors import BadInput, CorruptCheckpoint, NotFound
from core.layout import is_manifest_name, is_staging, manifest_name
from core.manifest import FileEntry, Manifest, ParentRef, attempt_digest, utcnow_iso
from core.paths import confine_local, safe_relpath
from core.storage.base import TierStore
from core.storage.local import LocalStore


def list_checkpoint_files(folder: str | os.PathLike) -> dict[str, int]:
    """{relative path: size} of every regular file of a checkpoint folder, manifests and
    staging files excluded. A symlink that leaves the folder raises ``PathEscape``."""
    root = Path(folder).absolute()
    if not root.is_dir():
        raise NotFound(f"checkpoint folder {str(root)!r} does not exist")
    out: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if is_staging(name) or ("/" not in rel and is_manifest_name(name)):
                continue
            path = confine_local(root, safe_relpath(rel))
            if path.is_file():
                out[rel] = path.stat().st_size
    return dict(sorted(out.items()))


def local_opener(folder: str | os.PathLike) -> Callable[[str], AbstractContextManager[BinaryIO]]:
    root = Path(folder)

    @contextmanager
    def opener(rel: str) -> Iterator[BinaryIO]:
        with open(confine_local(root, rel), "rb") as fh:
            yield fh

    return opener


def build_manifest(
    folder: str | os.PathLike,
    run: str,
    step: int,
    *,
    part: int = 0,
    parts: int = 1,
    node: str = "",
    kind: str = "step",
    metrics: Mapping[str, float] | None = None,
    tags: Mapping[str, str] | None = None,
    parent: ParentRef | None = None,
    writer_stall_seconds: float | None = None,
    attempt: str = "",
    fmt: str | None = None,
    parallelism: int = 4,
    buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
) -> Manifest:
    """The manifest of the files in ``folder`` (not yet written). ``fmt`` overrides detection.

    Raises ``CorruptCheckpoint`` if the folder fails its format's validation, ``BadInput``
    for an empty folder or bad names.
    """
    sizes = list_checkpoint_files(folder)
    if not sizes:
        raise BadInput(f"checkpoint folder {str(folder)!r} holds no files")
    fmt = fmt or formats.detect_format(list(sizes))
    formats.validate(fmt, sizes, local_opener(folder), complete=parts == 1)
    root = Path(folder)

    def one(rel: str) -> FileEntry:
        size, crc = checksum.hash_file(root / rel, buffer_bytes)
        if size != sizes[rel]:
            raise CorruptCheckpoint(f"{rel}: changed size while the manifest was built", path=rel)
        return FileEntry(path=rel, size=size, checksum=crc)

    with ThreadPoolExecutor(max(1, min(parallelism, len(sizes)))) as pool:
        files = tuple(pool.map(one, sizes))
    m = Manifest(
        run=run, step=step, files=files, format=fmt, algorithm=checksum.ALGORITHM,
        part=part, parts=parts, node=node, kind=kind,
        metrics=dict(metrics or {}), tags=dict(tags or {}), parent=parent,
        writer_stall_seconds=writer_stall_seconds, created_at=utcnow_iso(), attempt=attempt,
    )
    m.validate()
    return m


def write_manifest(folder: str | os.PathLike, manifest: Manifest) -> Path:
    """Publish ``manifest`` in ``folder`` atomically and durably: the part is now committed.
    Rewriting identical bytes is a no-op; different bytes raise ``ConflictError``."""
    store = LocalStore(folder, tier=0)
    store.write_small_atomic(manifest.name, manifest.to_json())
    return store.path(manifest.name)


def read_attempt_digest(store: TierStore, prefix: str, part: int = 0, parts: int = 1) -> str:
    """``core.manifest.attempt_digest`` of the part's manifest as it is on ``store`` now."""
    key = f"{prefix}/{manifest_name(part, parts)}" if prefix else manifest_name(part, parts)
    if store.stat(key) is None:
        return attempt_digest(None)
    return attempt_digest(store.read_small(key))


def read_manifest(store: TierStore, prefix: str, part: int = 0, parts: int = 1) -> Manifest:
    """The committed manifest of a part under ``prefix`` (``NotFound`` if not committed)."""
    key = f"{prefix}/{manifest_name(part, parts)}" if prefix else manifest_name(part, parts)
    try:  # one request, no stat first: on S3 each is a round trip to the first byte
        return Manifest.from_json(store.read_small(key))
    except NotFound:
        raise NotFound(f"no manifest at {store.url_for(key)}") from None
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"{store.url_for(key)}: {exc}", path=manifest_name(part, parts)) from None
