"""Write tensors as safetensors shards, with each file's CRC32C, hashing every byte once.

Each tensor's CRC32C is computed once: before writing (``tensor_crcs``, over the host copy the
caller holds), when the caller needs it to plan the shards (``ckpt.client``: which tensors did
not change since the previous save, a fine-tune's frozen base), else as it is written, each
slice right after its write. A shard file's CRC32C is derived from its header's CRC and its
tensors' CRCs (``checksum.combine``), so the manifest needs no second read of the shard. The
format (8-byte little-endian header length, JSON header padded to 8 bytes, raw little-endian
tensor bytes) is written here rather than through ``safetensors.numpy.save_file`` because
that function builds the whole file in memory first.

Accepted tensors: numpy arrays, anything with ``__array__``, and torch tensors (moved to CPU;
bfloat16 written as ``BF16``) without importing torch here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import checksum
from core.errors import BadInput
from core.progress import moved

_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "int32": "I32", "uint32": "U32", "float32": "F32",
    "int64": "I64", "uint64": "U64", "float64": "F64", "bfloat16": "BF16",
}
INDEX_NAME = "model.safetensors.index.json"
PIECE_BYTES = 64 * 1024 * 1024  # a thread's share of the tensors' CRC32C pass (tensor_crcs)


@dataclass(frozen=True)
class WrittenFile:
    path: str  # relative to the folder written into
    size: int
    checksum: str  # crc32c hex


def as_host_array(t: Any) -> tuple[np.ndarray, str]:  # a torch.Tensor or anything numpy takes
    """A C-contiguous little-endian numpy view (or copy) of ``t`` and its safetensors dtype."""
    if hasattr(t, "detach") and hasattr(t, "cpu"):  # torch.Tensor, without importing torch
        t = t.detach().cpu().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch

            return np.asarray(t.view(torch.int16).numpy()), "BF16"
        t = t.numpy()
    a = np.ascontiguousarray(np.asarray(t))
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    st = _DTYPES.get(a.dtype.name)
    if st is None:
        raise BadInput(f"cannot write dtype {a.dtype} as safetensors")
    return a, st


def snapshot(tensors: Mapping[str, object],
             reuse: Mapping[str, tuple[np.ndarray, str]] | None = None) -> dict[str, tuple[np.ndarray, str]]:
    """A private host-memory copy of every tensor: training may change its own right after.

    ``reuse``: the buffers of an earlier snapshot whose write has finished; a tensor of the
    same shape and dtype is copied into its old buffer instead of fresh memory. Copying into
    pages already mapped is what keeps the stall short from the second save on (a fresh
    allocation pays a page fault per 4 KiB on first touch, as much as the copy itself).
    """
    out = {}
    for name, t in tensors.items():
        a, st = as_host_array(t)
        old = reuse.get(name) if reuse else None
        if old is not None and old[1] == st and old[0].shape == a.shape and old[0].dtype == a.dtype:
            np.copyto(old[0], a)
            out[name] = (old[0], st)
        else:
            out[name] = (a.copy(), st)
    return out


def plan_shards(arrays: Mapping[str, tuple[np.ndarray, str]], shard_bytes: int,
                apart: Collection[str] = ()) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``shard_bytes`` (a bigger tensor: alone).
    The names in ``apart`` (tensors that do not change between saves, a fine-tune's frozen
    base) come first, in shards of their own: the same tensors give the same files, which the
    shared tiers then hold once."""
    if apart:
        kept = [n for n in arrays if n in apart]
        first = plan_shards({n: arrays[n] for n in kept}, shard_bytes) if kept else []
        rest = {n: arrays[n] for n in arrays if n not in apart}
        return first + (plan_shards(rest, shard_bytes) if rest else [])
    shards: list[list[str]] = [[]]
    used = 0
    for name in arrays:  # insertion order: deterministic file contents for the same input
        n = arrays[name][0].nbytes
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return [s for s in shards if s] or [[]]


def _header(names: list[str], arrays: Mapping[str, tuple[np.ndarray, str]]) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "np"}}
    offset = 0
    for name in names:
        a, st = arrays[name]
        meta[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _raw(a: np.ndarray) -> memoryview:
    """The array's bytes (a tensor with a 0 in its shape: none; ``cast`` refuses those)."""
    return a.data.cast("B") if a.nbytes else memoryview(b"")


def tensor_crcs(arrays: Mapping[str, tuple[np.ndarray, str]], *,
                buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES, threads: int = 4) -> dict[str, int]:
    """The CRC32C of every tensor's bytes. Hashed in pieces of ``PIECE_BYTES`` on ``threads``
    threads (CRC32C releases the GIL; a big tensor is as many pieces, their CRCs combined), each
    piece in ``buffer_bytes`` slices (the process's heartbeat beats during a long one)."""
    def piece(view: memoryview) -> int:
        crc = 0
        for start in range(0, len(view), buffer_bytes):
            crc = checksum.update(crc, view[start:start + buffer_bytes])
        return crc

    views = {name: _raw(a) for name, (a, _) in arrays.items()}
    pieces = [(name, view[start:start + PIECE_BYTES])
              for name, view in views.items() for start in range(0, len(view), PIECE_BYTES)]
    if threads > 1 and len(pieces) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="ckpt-crc") as pool:
            crcs = list(pool.map(piece, (v for _, v in pieces)))
    else:
        crcs = [piece(v) for _, v in pieces]
    out = dict.fromkeys(views, 0)
    for (name, view), crc in zip(pieces, crcs, strict=True):
        out[name] = checksum.combine(out[name], crc, len(view))
    return out


def write_shard(path: str | os.PathLike, names: list[str], arrays: Mapping[str, tuple[np.ndarray, str]],
                crcs: MutableMapping[str, int], *, buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
                fsync: bool = True) -> tuple[int, str]:
    """Write one safetensors file; return its (size, crc32c hex), the CRC combined from the
    header's and the tensors'. ``crcs``: the tensors' CRCs known already (``tensor_crcs`` of
    these same bytes); a tensor it lacks is hashed as it is written, each slice right after
    its write (still in the CPU's cache), and its CRC added to ``crcs``."""
    header = _header(names, arrays)
    crc, size = checksum.update(0, header), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        def put(view: memoryview) -> None:
            nonlocal size
            while view:
                n = os.write(fd, view)
                size += n
                view = view[n:]

        put(memoryview(header))
        for name in names:
            data, known, value = _raw(arrays[name][0]), crcs.get(name), 0
            for start in range(0, len(data), buffer_bytes):
                put(data[start:start + buffer_bytes])
                if known is None:
                    value = checksum.update(value, data[start:start + buffer_bytes])
                else:
                    moved()
            if known is None:
                crcs[name] = known = value
            crc = checksum.combine(crc, known, len(data))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size, checksum.to_hex(crc)


def unchanged_files(folder: str | os.PathLike, files: Iterable[tuple[str, int, str]],
                    arrays: Mapping[str, tuple[np.ndarray, str]], crcs: Mapping[str, int]) -> set[str]:
    """The tensors of the safetensors ``files`` in ``folder`` (``(path, size, crc32c hex)`` as a
    manifest lists them) that ``arrays`` holds again byte for byte: those of each file whose
    CRC32C is what its header, read back, and the current tensors' ``crcs`` combine to (the
    tensors' bytes on disk are not read)."""
    out: set[str] = set()
    for path, size, crc in files:
        if not path.endswith(".safetensors"):
            continue
        try:
            with open(os.path.join(folder, path), "rb") as fh:
                length = int.from_bytes(fh.read(8), "little")
                if not 0 < length <= min(size - 8, 100 << 20):
                    continue
                header = fh.read(length)
            meta = json.loads(header)
        except (OSError, ValueError):
            continue
        try:  # a header this writer did not write, or a damaged one: nothing learned from it
            entries = []
            for name, v in meta.items():
                if name != "__metadata__":
                    start, end = v["data_offsets"]
                    entries.append((int(start), int(end), name, v["dtype"], list(v["shape"])))
            entries.sort()
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
        value, offset = checksum.update(0, length.to_bytes(8, "little") + header), 0
        for start, end, name, dtype, shape in entries:
            have = arrays.get(name)
            if have is None or (start, end) != (offset, offset + have[0].nbytes) or dtype != have[1] \
                    or shape != list(have[0].shape):
                break
            value, offset = checksum.combine(value, crcs[name], end - start), end
        else:
            if 8 + length + offset == size and checksum.to_hex(value) == crc:
                out.update(e[2] for e in entries)
    return out


def fsync_all(paths: list[str], threads: int = 8) -> None:
    """fsync every file, several at once (each fsync waits on the disk without the GIL; the
    file system batches concurrent ones into fewer journal commits)."""
    def one(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if len(paths) <= 1:
        for p in paths:
            one(p)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix="ckpt-fsync") as pool:
        list(pool.map(one, paths))


def write_sharded(folder: str | os.PathLike, arrays: Mapping[str, tuple[np.ndarray, str]], *,
                  shard_bytes: int, prefix: str = "", buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
                  fsync: bool = True, apart: Collection[str] = (),
                  crcs: MutableMapping[str, int] | None = None) -> list[WrittenFile]:
    """Hugging Face sharded layout under ``folder/prefix``: ``model-0000i-of-0000n.safetensors``
    plus ``model.safetensors.index.json`` (its ``weight_map`` names every shard); the tensors
    in ``apart`` in shards of their own (``plan_shards``). ``crcs``: the tensors' CRC32Cs the
    caller has already; the others are computed as written and added (``write_shard``)."""
    if crcs is None:
        crcs = {}
    groups = plan_shards(arrays, shard_bytes, apart)
    base = os.path.join(folder, prefix) if prefix else os.fspath(folder)
    os.makedirs(base, exist_ok=True)
    written, weight_map, total, paths = [], {}, 0, []
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        paths.append(os.path.join(base, fname))
        size, crc = write_shard(paths[-1], names, arrays, crcs, buffer_bytes=buffer_bytes, fsync=False)
        written.append(WrittenFile(f"{prefix}{fname}", size, crc))
        weight_map.update(dict.fromkeys(names, fname))
        total += sum(arrays[n][0].nbytes for n in names)
    if fsync:  # once all are written: the disk writes shard i back while shard i+1 is written
        fsync_all(paths)
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
    with open(os.path.join(base, INDEX_NAME), "xb") as fh:
        fh.write(index)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    written.append(WrittenFile(f"{prefix}{INDEX_NAME}", len(index), checksum.hash_bytes(index)))
    return written
