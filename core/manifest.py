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
import math
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.errors import BadInput, CkptError, CorruptCheckpoint, quoted
from core.layout import MAX_STEP, check_attempt, check_ref, is_manifest_name, manifest_name
from core.paths import safe_relpath, safe_run_name

MANIFEST_VERSION = 1
KINDS = ("step", "epoch", "milestone")
FORMATS = ("safetensors", "hf-sharded", "dcp", "folder")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
# the hex digest of each checksum algorithm a manifest may name
CHECKSUMS = {"crc32c": re.compile(r"[0-9a-f]{8}")}
# the longest string the catalog's columns hold (db/models.py; a test keeps the two in step),
# and the bounds of what the catalog keeps as JSON (metric and tag names, tag values)
MAX_NODE = 256
MAX_PATH = 1024
MAX_NAME = 128
MAX_TAG_VALUE = 1024
MAX_BYTES = MAX_STEP  # a size, and the sum of a part's sizes, is a signed 64-bit integer too


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
                FileEntry(path=str(f["path"]), size=_whole(f["size"], "size"), checksum=str(f["checksum"]))
                for f in d["files"]
            )
            parent = d.get("parent")
            m = cls(
                run=str(d["run"]),
                step=_whole(d["step"], "step"),
                files=files,
                format=str(d.get("format", "folder")),
                algorithm=str(d.get("algorithm", "crc32c")),
                part=_whole(d.get("part", 0), "part"),
                parts=_whole(d.get("parts", 1), "parts"),
                node=str(d.get("node", "")),
                kind=str(d.get("kind", "step")),
                metrics={str(k): _number(v, f"metric {k!r}") for k, v in (d.get("metrics") or {}).items()},
                tags={str(k): str(v) for k, v in (d.get("tags") or {}).items()},
                parent=_parent(parent) if parent else None,
                writer_stall_seconds=d.get("writer_stall_seconds"),  # checked by validate
                created_at=str(d.get("created_at", "")),
                version=int(d.get("version", MANIFEST_VERSION)),
                attempt=str(d.get("attempt", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"unreadable manifest: {exc}", path="manifest.json") from exc
        m.validate()
        return m

    def validate(self) -> None:
        """Every field within what the catalog holds and the layout allows; ``BadInput`` (or
        ``PathEscape``) naming the first that is not, in one line. What passes here is stored
        as it is, on every catalog backend: a bad manifest is refused once, never retried."""
        safe_run_name(self.run)
        check_ref(self.step, self.part, self.parts)
        check_attempt(self.attempt)
        if self.parent is not None:
            safe_run_name(self.parent.run)
            check_ref(self.parent.step)
            _one_of(self.parent.relation, ORIGIN_RELATIONS, "invalid parent relation")
        _one_of(self.kind, KINDS, "invalid kind")
        _one_of(self.format, FORMATS, "unknown format")
        _one_of(self.algorithm, tuple(CHECKSUMS), "unknown checksum algorithm")
        _text(self.node, MAX_NODE, "node")
        for name, value in self.metrics.items():
            _text(name, MAX_NAME, "metric name")
            _number(value, f"metric {quoted(name)}")  # NaN and inf too: a diverged run is recorded as such
        for key, tag in self.tags.items():
            _text(key, MAX_NAME, "tag name")
            _text(tag, MAX_TAG_VALUE, f"tag {quoted(key)}")
        if self.writer_stall_seconds is not None and not _seconds(self.writer_stall_seconds):
            raise BadInput(f"writer_stall_seconds {quoted(self.writer_stall_seconds)} is not a finite "
                           "number of seconds >= 0")
        if self.created_at:
            try:
                datetime.fromisoformat(self.created_at)
            except (TypeError, ValueError):
                raise BadInput(f"created_at {quoted(self.created_at)} is not an ISO-8601 time") from None
        self._validate_files()

    def _validate_files(self) -> None:
        digest = CHECKSUMS[self.algorithm]
        seen, total = set(), 0
        for f in self.files:
            _text(f.path, MAX_PATH, "file path")
            safe_relpath(f.path)
            if f.path in seen:
                raise BadInput(f"duplicate file {quoted(f.path)} in manifest")
            if is_manifest_name(f.path.rsplit("/", 1)[-1]) and "/" not in f.path:
                raise BadInput(f"manifest lists a manifest file {quoted(f.path)}")
            if not isinstance(f.size, int) or isinstance(f.size, bool) or not 0 <= f.size <= MAX_BYTES:
                raise BadInput(f"size {quoted(f.size)} of {quoted(f.path)} is out of range: a size is 0..{MAX_BYTES}")
            if not isinstance(f.checksum, str) or not digest.fullmatch(f.checksum):
                raise BadInput(f"checksum {quoted(f.checksum)} of {quoted(f.path)} is not a {self.algorithm} "
                               f"digest ({digest.pattern})")
            seen.add(f.path)
            total += f.size
        if total > MAX_BYTES:
            raise BadInput(f"the part's files add up to {total} bytes, over {MAX_BYTES} (2**63-1)")


def _one_of(value: object, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise BadInput(f"{what} {quoted(value)}; expected one of {allowed}")


def _text(value: object, limit: int, what: str) -> None:
    if not isinstance(value, str) or len(value) > limit:
        raise BadInput(f"{what} {quoted(value)} is not a string of at most {limit} characters")


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _whole(value: object, what: str) -> int:
    """A JSON integer (not a string, a float or a boolean that ``int()`` would turn into one)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadInput(f"{what} {quoted(value)} is not an integer")
    return value


def _number(value: object, what: str) -> float:
    """A JSON number as a float (Python's JSON reads and writes NaN and Infinity as numbers too)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadInput(f"{what} is {quoted(value)}: a metric is a number")
    return float(value)


def _parent(value: object) -> ParentRef:
    if not isinstance(value, dict):
        raise BadInput(f"parent {quoted(value)} is not an object with run, step and relation")
    return ParentRef(run=str(value["run"]), step=_whole(value["step"], "parent step"),
                     relation=str(value.get("relation", "resumed_from")))


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
