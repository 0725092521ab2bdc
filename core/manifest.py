"""The manifest: the list of every file of one checkpoint part, with size and checksum.

A checkpoint of run R at step S may be written by several nodes; each node's share is a
*part* (``part`` in ``0..parts-1``) with its own manifest. A single-node checkpoint is part 0
of 1. The manifest is written last and atomically: its presence is the commit marker of the
part on any tier.

File name: ``manifest.json`` for a single-part checkpoint, ``manifest.part-00003-of-00004.json``
for part 3 of 4, so that all parts can live side by side in one checkpoint folder on Tier 1/2.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.errors import BadInput, CkptError, CorruptCheckpoint
from core.layout import check_ref, is_manifest_name, manifest_name
from core.paths import safe_relpath

MANIFEST_VERSION = 1
KINDS = ("step", "epoch", "milestone")
FORMATS = ("safetensors", "hf-sharded", "dcp", "folder")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint folder, '/'-separated, confined (see core.paths)
    size: int
    checksum: str  # hex digest of ``Manifest.algorithm``


ORIGIN_RELATIONS = ("resumed_from", "fine_tuned_from", "branched_from")


@dataclass(frozen=True)
class ParentRef:
    """The checkpoint this one comes from. A stager created with an origin writes the run's
    origin into every manifest, so the catalog learns it from any of them (``db.register``)."""

    run: str
    step: int
    relation: str = "resumed_from"  # one of ORIGIN_RELATIONS


@dataclass(frozen=True)
class Manifest:
    run: str
    step: int
    files: tuple[FileEntry, ...]
    format: str = "folder"
    algorithm: str = "crc32c"
    part: int = 0
    parts: int = 1
    node: str = ""
    kind: str = "step"  # step | epoch | milestone
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    parent: ParentRef | None = None
    writer_stall_seconds: float | None = None
    created_at: str = ""  # ISO-8601 UTC
    version: int = MANIFEST_VERSION
    attempt: str = ""  # the training attempt (one launch of the job) that wrote the part

    # --- identity ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return manifest_name(self.part, self.parts)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def digest(self) -> str:
        """Content identity of the part: what registering the same part twice must match.

        Covers run, step, part/parts, algorithm and every (path, size, checksum); not times,
        metrics or the node name, which a rewrite of identical bytes may change.
        """
        body = {
            "run": self.run,
            "step": self.step,
            "part": self.part,
            "parts": self.parts,
            "algorithm": self.algorithm,
            "files": sorted((f.path, f.size, f.checksum) for f in self.files),
        }
        if self.attempt:  # the unnamed attempt's digests stay what they were before attempts
            body["attempt"] = self.attempt
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    # --- serialisation -------------------------------------------------------------
    def to_json(self) -> bytes:
        d = asdict(self)
        d["files"] = [asdict(f) for f in self.files]
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        try:
            d: dict[str, Any] = json.loads(data)
            if not isinstance(d, dict):
                raise TypeError("manifest is not a JSON object")
            files = tuple(
                FileEntry(path=str(f["path"]), size=int(f["size"]), checksum=str(f["checksum"]))
                for f in d["files"]
            )
            parent = d.get("parent")
            m = cls(
                run=str(d["run"]),
                step=int(d["step"]),
                files=files,
                format=str(d.get("format", "folder")),
                algorithm=str(d.get("algorithm", "crc32c")),
                part=int(d.get("part", 0)),
                parts=int(d.get("parts", 1)),
                node=str(d.get("node", "")),
                kind=str(d.get("kind", "step")),
                metrics={str(k): float(v) for k, v in (d.get("metrics") or {}).items()},
                tags={str(k): str(v) for k, v in (d.get("tags") or {}).items()},
                parent=ParentRef(**parent) if parent else None,
                writer_stall_seconds=d.get("writer_stall_seconds"),
                created_at=str(d.get("created_at", "")),
                version=int(d.get("version", MANIFEST_VERSION)),
                attempt=str(d.get("attempt", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"unreadable manifest: {exc}", path="manifest.json") from exc
        m.validate()
        return m

    def validate(self) -> None:
        """Structural checks; raises ``BadInput`` (or ``PathEscape``) on the first problem."""
        if not self.run or "/" in self.run or self.run.startswith("."):
            raise BadInput(f"invalid run name {self.run!r}")
        check_ref(self.step, self.part, self.parts)
        if self.parent is not None:
            check_ref(self.parent.step)
            if self.parent.relation not in ORIGIN_RELATIONS:
                raise BadInput(f"invalid parent relation {self.parent.relation!r}; expected one of {ORIGIN_RELATIONS}")
        if self.kind not in KINDS:
            raise BadInput(f"invalid kind {self.kind!r}; expected one of {KINDS}")
        if self.format not in FORMATS:
            raise BadInput(f"unknown format {self.format!r}; expected one of {FORMATS}")
        seen = set()
        for f in self.files:
            safe_relpath(f.path)
            if f.path in seen:
                raise BadInput(f"duplicate file {f.path!r} in manifest")
            if is_manifest_name(f.path.rsplit("/", 1)[-1]) and "/" not in f.path:
                raise BadInput(f"manifest lists a manifest file {f.path!r}")
            if f.size < 0:
                raise BadInput(f"negative size for {f.path!r}")
            seen.add(f.path)


def attempt_digest(data: bytes | None) -> str:
    """The identity of one attempt to commit a part: its manifest's ``digest()`` when the bytes
    parse, else ``raw:`` and the SHA-256 of the bytes, ``absent`` when there is no manifest.
    A rejection is recorded against this, so a re-save with another manifest is a new attempt."""
    if data is None:
        return "absent"
    try:
        return Manifest.from_json(data).digest()
    except (CkptError, ValueError, TypeError, KeyError, AttributeError):
        return "raw:" + hashlib.sha256(data).hexdigest()


def utcnow_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
