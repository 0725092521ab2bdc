"""Checkpoint formats: detected from file names, validated from bytes (never just hashed).

Formats (``core.manifest.FORMATS``):
- ``safetensors``: one ``*.safetensors`` file (plus anything else) without an index;
- ``hf-sharded``: Hugging Face sharded safetensors, ``model.safetensors.index.json`` whose
  ``weight_map`` names shards that must all be present, each a valid safetensors file;
- ``dcp``: a PyTorch Distributed Checkpoint folder, ``.metadata`` plus ``*.distcp`` data files;
- ``folder``: anything else; the manifest's sizes and checksums are all there is to check.

Validation reads through an ``opener(relpath) -> context manager of a binary reader`` and a
``{relpath: size}`` map, so the same code checks a local folder, Tier 1 or an S3 prefix.
Every defect is a ``CorruptCheckpoint(path=..., reason)``. Hostile input is bounded: a
safetensors header is at most ``MAX_HEADER_BYTES`` and must fit inside the file; index and
metadata files are read with a size limit; nothing is unpickled.
"""

from __future__ import annotations

import json
import pickletools
import struct
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import BinaryIO

from core.errors import CorruptCheckpoint

Opener = Callable[[str], AbstractContextManager[BinaryIO]]

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_DCP_METADATA_BYTES = 256 * 1024 * 1024
HF_INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"

# Bits per element of every safetensors dtype (sub-byte float formats pack several per byte).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def _basename(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


def detect_format(paths: list[str] | tuple[str, ...]) -> str:
    """The format a set of relative paths looks like (names only; ``validate`` checks bytes)."""
    names = {_basename(p) for p in paths}
    if HF_INDEX in names:
        return "hf-sharded"
    if DCP_METADATA in names or any(n.endswith(".distcp") for n in names):
        return "dcp"
    if sum(1 for n in names if n.endswith(".safetensors")) == 1:
        return "safetensors"
    return "folder"


def read_exact(reader: BinaryIO, n: int, rel: str) -> bytes:
    """Read exactly ``n`` bytes (streams may return short reads) or raise CorruptCheckpoint."""
    chunks, got = [], 0
    while got < n:
        data = reader.read(min(n - got, 4 * 1024 * 1024))
        if not data:
            raise CorruptCheckpoint(f"{rel}: truncated (wanted {n} bytes, got {got})", path=rel)
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _bad(rel: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{rel}: {reason}", path=rel)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_safetensors_header(header: bytes, data_size: int, rel: str) -> int:
    """Validate a parsed-to-be safetensors JSON header against the data section size.

    Checks: a JSON object; ``__metadata__`` (if any) maps str to str; every tensor has a known
    dtype, a shape of non-negative ints, ``data_offsets`` [begin, end] with
    ``dtype bits x prod(shape) / 8 == end - begin``; the spans, sorted, start at 0, touch
    without gap or overlap and end exactly at ``data_size``. Returns the tensor count.
    """
    try:
        doc = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(rel, f"safetensors header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise _bad(rel, "safetensors header is not a JSON object")
    spans: list[tuple[int, int, str]] = []
    for name, info in doc.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _bad(rel, "__metadata__ must map strings to strings")
            continue
        if not isinstance(info, dict):
            raise _bad(rel, f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise _bad(rel, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _bad(rel, f"tensor {name!r}: shape must be a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(o) for o in offsets)):
            raise _bad(rel, f"tensor {name!r}: data_offsets must be [begin, end] ints")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise _bad(rel, f"tensor {name!r}: offsets {offsets} outside the data ({data_size} bytes)")
        count = 1
        for d in shape:
            count *= d
            if count > data_size * 8:  # bound the product: no arithmetic on absurd numbers
                raise _bad(rel, f"tensor {name!r}: shape {shape} larger than the file")
        bits = count * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != end - begin:
            raise _bad(rel, f"tensor {name!r}: {dtype} x {shape} is not {end - begin} bytes")
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            kind = "overlaps the previous tensor" if begin < pos else f"leaves a gap at {pos}"
            raise _bad(rel, f"tensor {name!r}: {kind}")
        pos = end
    if pos != data_size:
        raise _bad(rel, f"tensors cover {pos} bytes but the data section has {data_size}")
    return len(spans)


def validate_safetensors(reader: BinaryIO, size: int, rel: str) -> int:
    """Validate a safetensors stream of ``size`` bytes; reads only the header. Returns tensor count."""
    if size < 8:
        raise _bad(rel, f"too small for a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", read_exact(reader, 8, rel))
    if n > MAX_HEADER_BYTES:
        raise _bad(rel, f"safetensors header length {n} exceeds the {MAX_HEADER_BYTES} byte bound")
    if 8 + n > size:
        raise _bad(rel, f"safetensors header length {n} exceeds the file size {size}")
    return check_safetensors_header(read_exact(reader, n, rel), size - 8 - n, rel)


def _read_bounded(opener: Opener, rel: str, size: int, limit: int) -> bytes:
    if size > limit:
        raise _bad(rel, f"{size} bytes exceeds the {limit} byte bound")
    with opener(rel) as fh:
        return read_exact(fh, size, rel)


def hf_index_shards(data: bytes, rel: str) -> set[str]:
    """The shard file names a ``model.safetensors.index.json`` refers to."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _bad(rel, "index is not valid JSON") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise _bad(rel, "index has no weight_map of tensor -> shard file name")
    return set(wm.values())


def dcp_referenced_files(data: bytes, rel: str) -> set[str]:
    """The ``*.distcp`` names a DCP ``.metadata`` pickle mentions, found without unpickling.

    ``.metadata`` is a pickle of ``torch.distributed.checkpoint.Metadata``; unpickling
    untrusted bytes runs code, so we never do it. Instead ``pickletools.genops`` walks the
    opcode stream (no execution) and collects string constants ending in ``.distcp``: the
    ``relative_path`` of each ``_StorageInfo``. Limits: offsets and lengths inside the data
    files are not checked, and a future DCP layout that stored names differently would yield
    an empty set (then only the presence of non-empty ``*.distcp`` files is checked).
    """
    names: set[str] = set()
    try:
        for _op, arg, _pos in pickletools.genops(data):
            if isinstance(arg, str) and arg.endswith(".distcp"):
                names.add(arg)
    except Exception as exc:  # noqa: BLE001 - genops raises ValueError and friends on malformed streams
        raise _bad(rel, f"not a readable pickle ({type(exc).__name__}: {exc})") from None
    return names


def _group_dir(rel: str) -> str:
    return rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""


def validate(fmt: str, sizes: Mapping[str, int], opener: Opener, *, complete: bool = True) -> None:
    """Validate the files of one checkpoint part as format ``fmt``.

    ``complete`` says the part holds the whole checkpoint (parts == 1): only then can
    cross-file references (index -> shards, .metadata -> data files) be required to resolve;
    with several parts, each part checks the files it holds.
    """
    rels = sorted(sizes)
    safetensors = [r for r in rels if r.endswith(".safetensors")]
    if fmt in ("safetensors", "hf-sharded"):
        for r in safetensors:
            with opener(r) as fh:
                validate_safetensors(fh, sizes[r], r)
    if fmt == "safetensors" and not safetensors:
        raise CorruptCheckpoint("no *.safetensors file in a safetensors checkpoint")
    if fmt == "hf-sharded":
        indexes = [r for r in rels if _basename(r) == HF_INDEX]
        if complete and not indexes:
            raise CorruptCheckpoint(f"{HF_INDEX} is missing", path=HF_INDEX)
        for idx in indexes:
            base = _group_dir(idx)
            for shard in sorted(hf_index_shards(_read_bounded(opener, idx, sizes[idx], MAX_INDEX_BYTES), idx)):
                if complete and base + shard not in sizes:
                    raise CorruptCheckpoint(f"{idx} refers to missing shard {shard!r}", path=base + shard)
    if fmt == "dcp":
        _validate_dcp(sizes, opener, complete)


def _validate_dcp(sizes: Mapping[str, int], opener: Opener, complete: bool) -> None:
    metas = [r for r in sizes if _basename(r) == DCP_METADATA]
    if complete and not metas:
        raise CorruptCheckpoint(f"{DCP_METADATA} is missing from a DCP checkpoint", path=DCP_METADATA)
    for r in sizes:
        if r.endswith(".distcp") and sizes[r] == 0:
            raise CorruptCheckpoint(f"{r}: empty DCP data file", path=r)
    for meta in metas:
        if sizes[meta] == 0:
            raise CorruptCheckpoint(f"{meta}: empty", path=meta)
        base = _group_dir(meta)
        data = _read_bounded(opener, meta, sizes[meta], MAX_DCP_METADATA_BYTES)
        for name in sorted(dcp_referenced_files(data, meta)):
            if complete and base + name not in sizes:
                raise CorruptCheckpoint(f"{meta} refers to missing data file {name!r}", path=base + name)
