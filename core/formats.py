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
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, BinaryIO

from core.errors import CorruptCheckpoint

if TYPE_CHECKING:
    from core.manifest import Manifest

Opener = Callable[[str], AbstractContextManager[BinaryIO]]

# The safetensors library's own bound (MAX_HEADER_SIZE in its Rust core): a header it would
# refuse is refused here too. No need for a lower cap: memory is bounded by parsing (below).
MAX_HEADER_BYTES = 100_000_000
# One tensor entry as JSON: three keys, a shape of 64 dims (numpy's limit) of up to 20 digits
# each and two offsets fit in ~1,700 characters; real entries take ~100-200. A longer entry is
# refused before it is parsed (a 'shape' of millions of zeros would otherwise pass).
MAX_ENTRY_CHARS = 4096
# ``__metadata__`` (str -> str, e.g. a serialized config): bounded so that it alone cannot make
# the parser build more than this many characters' worth of objects.
MAX_METADATA_CHARS = 16 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_DCP_METADATA_BYTES = 256 * 1024 * 1024
HF_INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
# What every part of a checkpoint needs to load, whichever part lists it: a resume brings them in
# beside a part, so a prune of that part takes them with it (``tasks.base.delete_part``).
WIDE_FILES = (DCP_METADATA, HF_INDEX)

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


def _check_tensor(name: str, info: object, data_size: int, rel: str) -> tuple[int, int]:
    """One tensor entry's (begin, end) after checking dtype, shape and offsets."""
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
    return begin, end


_DECODER = json.JSONDecoder()
# JSONDecoder.__init__ sets scan_once (json.scanner.make_scanner(self)); typeshed does not declare it.
_SCAN_ONCE: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
# json.decoder's string scanner (C or pure Python), which typeshed's json/decoder.pyi does not declare.
_SCANSTRING: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WS = re.compile(r"[ \t\n\r]*")


def _skip_ws(text: str, idx: int) -> int:
    """The index of the first non-whitespace character at or after ``idx``."""
    m = _WS.match(text, idx)
    if m is None:  # unreachable: ``[ \t\n\r]*`` matches the empty string at any position
        return idx
    return m.end()


def _scan_value(text: str, idx: int, limit: int, what: str, rel: str) -> tuple[Any, int]:
    """The JSON value at ``text[idx:]``, parsed from a window of at most ``limit`` characters
    (so no single entry can make the parser build more than ``limit`` characters' worth of
    objects); returns (value, end index in ``text``)."""
    window = None
    if len(text) - idx > limit:
        close = text.find("}", idx, idx + limit)  # a tensor entry ends at its first '}'
        window = text[idx:close + 1] if close >= 0 else text[idx:idx + limit]
        try:
            value, end = _SCAN_ONCE(window, 0)
            return value, idx + end
        except (StopIteration, ValueError, RecursionError):
            window = text[idx:idx + limit]  # a '}' inside a string, or nested: the full window
    try:
        value, end = _SCAN_ONCE(window if window is not None else text, 0 if window is not None else idx)
    except StopIteration:
        too_long = window is not None
        problem = f"longer than {limit} characters" if too_long else "not valid JSON"
        raise _bad(rel, f"{what}: {problem}") from None
    except (ValueError, RecursionError) as exc:
        raise _bad(rel, f"{what}: not valid JSON ({type(exc).__name__})") from None
    return value, (idx + end if window is not None else end)


def _iter_header(text: str, rel: str) -> Iterator[tuple[str, Any]]:
    """(key, value) pairs of the header's top-level JSON object, parsed one entry at a time:
    the whole header is never materialized as Python objects (json.loads of a large header
    takes several times its size in memory; see ``check_safetensors_header``)."""
    idx = _skip_ws(text, 0)
    if text[idx:idx + 1] != "{":
        raise _bad(rel, "safetensors header is not a JSON object")
    idx = _skip_ws(text, idx + 1)
    if text[idx:idx + 1] == "}":
        idx += 1
    else:
        while True:
            if text[idx:idx + 1] != '"':
                raise _bad(rel, "safetensors header is not valid JSON (expected a tensor name)")
            try:
                key, idx = _SCANSTRING(text, idx + 1)
            except ValueError:
                raise _bad(rel, "safetensors header is not valid JSON (bad string)") from None
            idx = _skip_ws(text, idx)
            if text[idx:idx + 1] != ":":
                raise _bad(rel, "safetensors header is not valid JSON (expected ':')")
            idx = _skip_ws(text, idx + 1)
            limit = MAX_METADATA_CHARS if key == "__metadata__" else MAX_ENTRY_CHARS
            value, idx = _scan_value(text, idx, limit, f"entry {key[:80]!r}", rel)
            yield key, value
            idx = _skip_ws(text, idx)
            sep = text[idx:idx + 1]
            idx = _skip_ws(text, idx + 1)
            if sep == "}":
                break
            if sep != ",":
                raise _bad(rel, "safetensors header is not valid JSON (expected ',' or '}')")
    if _skip_ws(text, idx) != len(text):
        raise _bad(rel, "safetensors header is not valid JSON (extra data after the object)")


def check_safetensors_header(header: bytes | bytearray, data_size: int, rel: str) -> int:
    """Validate a safetensors JSON header against the data section size.

    Checks: a JSON object; ``__metadata__`` (if any) maps str to str; every tensor has a known
    dtype, a shape of non-negative ints, ``data_offsets`` [begin, end] with
    ``dtype bits x prod(shape) / 8 == end - begin``; the spans, sorted, start at 0, touch
    without gap or overlap and end exactly at ``data_size``. Returns the tensor count.

    Memory is bounded by the header's size, not by its entry count: entries are parsed one at
    a time (``_iter_header``) and only each span is kept, packed in one int: the peak is the
    header's bytes and its text.
    """
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(rel, "safetensors header is not valid JSON (UnicodeDecodeError)") from None
    spans: list[int] = []  # begin * (data_size + 1) + end: sorts by begin, then end
    scale = data_size + 1
    for name, info in _iter_header(text, rel):
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _bad(rel, "__metadata__ must map strings to strings")
            continue
        begin, end = _check_tensor(name, info, data_size, rel)
        spans.append(begin * scale + end)
    del text
    spans.sort()
    pos = 0
    for packed in spans:
        begin, end = divmod(packed, scale)
        if begin != pos:
            kind = "overlaps the previous tensor" if begin < pos else f"leaves a gap at {pos}"
            raise _bad(rel, f"tensor at data_offsets [{begin}, {end}] {kind}")
        pos = end
    if pos != data_size:
        raise _bad(rel, f"tensors cover {pos} bytes but the data section has {data_size}")
    return len(spans)


def _read_header(reader: BinaryIO, n: int, rel: str) -> bytearray:
    """Exactly ``n`` bytes into one buffer (no list of chunks joined into a second copy)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        chunk = min(n - got, 4 * 1024 * 1024)
        if hasattr(reader, "readinto"):
            k = reader.readinto(view[got:got + chunk]) or 0
        else:
            data = reader.read(chunk)
            k = len(data)
            view[got:got + k] = data
        if not k:
            raise CorruptCheckpoint(f"{rel}: truncated (wanted {n} bytes, got {got})", path=rel)
        got += k
    view.release()
    return buf


def validate_safetensors(reader: BinaryIO, size: int, rel: str) -> int:
    """Validate a safetensors stream of ``size`` bytes; reads only the header. Returns tensor count."""
    if size < 8:
        raise _bad(rel, f"too small for a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", read_exact(reader, 8, rel))
    if n > MAX_HEADER_BYTES:
        raise _bad(rel, f"safetensors header length {n} exceeds the {MAX_HEADER_BYTES} byte bound")
    if 8 + n > size:
        raise _bad(rel, f"safetensors header length {n} exceeds the file size {size}")
    return check_safetensors_header(_read_header(reader, n, rel), size - 8 - n, rel)


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


DCP_METADATA_GLOBAL = ("torch.distributed.checkpoint.metadata", "Metadata")
# One of these per state-dict entry: a Metadata without any describes nothing.
DCP_ENTRY_GLOBALS = {("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
                     ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")}
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
               "BINSTRING", "STRING"}


def _pickle_scan(data: bytes, rel: str) -> tuple[list[tuple[str, str]], set[str]]:
    """(globals in order of reference, strings ending in ``.distcp``) of a pickle, found by
    walking its opcodes with ``pickletools.genops``: nothing is executed or constructed.

    ``GLOBAL`` carries "module name"; ``STACK_GLOBAL`` (protocol 4+) takes the two strings on
    top of the stack, pushed directly or fetched from the memo, which is tracked for strings.
    """
    globals_: list[tuple[str, str]] = []
    names: set[str] = set()
    recent: list[str | None] = []  # the top of the stack: a string, or None for anything else
    memo: dict[int, str | None] = {}
    try:
        # genops decodes every string opcode's argument to str, a memo index to int, and GLOBAL's
        # two lines to one "module name" str; the isinstance checks only narrow the types.
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _STRING_OPS:
                string = arg if isinstance(arg, str) else None
                recent.append(string)
                if string is not None and string.endswith(".distcp"):
                    names.add(string)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if isinstance(arg, int):
                    memo[arg] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(arg) if isinstance(arg, int) else None)
            elif name == "GLOBAL":
                if isinstance(arg, str):
                    module, qualname = arg.split(" ", 1)
                    globals_.append((module, qualname))
            elif name == "STACK_GLOBAL":
                if len(recent) >= 2 and isinstance(recent[-2], str) and isinstance(recent[-1], str):
                    globals_.append((recent[-2], recent[-1]))
            elif name not in ("PROTO", "FRAME"):
                recent.append(None)  # anything else on the stack breaks a string pair
            del recent[:-2]
    except Exception as exc:  # noqa: BLE001 - genops raises ValueError and friends on malformed streams
        raise _bad(rel, f"not a readable pickle ({type(exc).__name__}: {exc})") from None
    return globals_, names


def dcp_referenced_files(data: bytes, rel: str) -> set[str]:
    """The ``*.distcp`` names a DCP ``.metadata`` pickle mentions, after checking that it has
    the shape of a ``torch.distributed.checkpoint.metadata.Metadata``; found without unpickling.

    ``.metadata`` is a pickle of that class; unpickling untrusted bytes runs code, so we never
    do it. Instead the opcode stream is walked (``_pickle_scan``): the first global it
    references (the class of the root object) must be ``Metadata``, it must reference at least
    one ``TensorStorageMetadata``/``BytesStorageMetadata`` (an entry of the state dict), and
    its string constants ending in ``.distcp`` are the ``relative_path`` of each
    ``_StorageInfo``. Anything else (``None``, a dict, another class) is CorruptCheckpoint.
    Limits: offsets and lengths inside the data files are not checked.
    """
    globals_, names = _pickle_scan(data, rel)
    # protocols 0-1 build an object through copyreg._reconstructor(cls, ...): skip that helper
    classes = [g for g in globals_ if g[1] != "_reconstructor" or g[0] not in ("copyreg", "copy_reg")]
    if not classes or classes[0] != DCP_METADATA_GLOBAL:
        got = ".".join(classes[0]) if classes else "no class at all"
        raise _bad(rel, f"not a torch.distributed.checkpoint Metadata pickle (its root is {got})")
    if not DCP_ENTRY_GLOBALS.intersection(globals_):
        raise _bad(rel, "DCP metadata describes no tensor or bytes entry (an empty state dict)")
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
        metadata = _read_bounded(opener, meta, sizes[meta], MAX_DCP_METADATA_BYTES)
        for name in sorted(dcp_referenced_files(metadata, meta)):
            if complete and base + name not in sizes:
                raise CorruptCheckpoint(f"{meta} refers to missing data file {name!r}", path=base + name)


def check_union_complete(manifests: Sequence[Manifest], opener: Opener) -> None:
    """Check that the parts of a multi-node checkpoint add up to a whole one.

    Each part's files are validated alone (``validate(..., complete=False)``); only the union
    shows whether the cross-file references resolve. ``manifests`` are every part's manifest;
    ``opener(relpath)`` reads a file of the checkpoint folder (where all parts live side by
    side, e.g. Tier 1). Rules, by the formats the parts declare:
    - ``hf-sharded``: some part holds ``model.safetensors.index.json`` (parts that hold one
      hold identical copies) and every shard its ``weight_map`` names is in some part;
    - ``dcp``: some part holds ``.metadata`` (identical copies if several) and every
      ``*.distcp`` it refers to is in some part.
    Raises CorruptCheckpoint naming the first missing file.
    """
    entries: dict[str, tuple[int, str]] = {}
    for m in manifests:
        for f in m.files:
            entries.setdefault(f.path, (f.size, f.checksum))
    declared = {m.format for m in manifests}
    if "hf-sharded" in declared:
        for idx in _one_copy_each(manifests, HF_INDEX):
            base = _group_dir(idx)
            for shard in sorted(hf_index_shards(_read_bounded(opener, idx, entries[idx][0], MAX_INDEX_BYTES), idx)):
                if base + shard not in entries:
                    raise CorruptCheckpoint(f"{idx} refers to shard {shard!r} that no part holds", path=base + shard)
    if "dcp" in declared:
        for meta in _one_copy_each(manifests, DCP_METADATA):
            base = _group_dir(meta)
            data = _read_bounded(opener, meta, entries[meta][0], MAX_DCP_METADATA_BYTES)
            for name in sorted(dcp_referenced_files(data, meta)):
                if base + name not in entries:
                    raise CorruptCheckpoint(f"{meta} refers to data file {name!r} that no part holds",
                                            path=base + name)


def _one_copy_each(manifests: Sequence[Manifest], basename: str) -> list[str]:
    """Paths named ``basename`` in any part; several parts holding one path must agree on its
    bytes (size and checksum); none at all is CorruptCheckpoint."""
    seen: dict[str, tuple[int, str, int]] = {}
    for m in manifests:
        for f in m.files:
            if _basename(f.path) != basename:
                continue
            first = seen.setdefault(f.path, (f.size, f.checksum, m.part))
            if first[:2] != (f.size, f.checksum):
                raise CorruptCheckpoint(f"{f.path}: parts {first[2]} and {m.part} hold different copies",
                                        path=f.path)
    if not seen:
        raise CorruptCheckpoint(f"{basename} is missing from every part of the checkpoint", path=basename)
    return sorted(seen)
