"""Load a restored checkpoint part with its format's own loader and check it against the manifest.

A drill that only copies bytes proves the bytes arrived; a restart needs the trainer's loader to
accept them. ``load_and_check(folder, files, fmt)``: every listed file has the manifest's size
and CRC32C (read in full), and then
- safetensors files (``safetensors``, ``hf-sharded``) are opened with the safetensors library
  and every tensor is materialised (torch when installed, else numpy), its byte size checked
  against its dtype and shape;
- a DCP folder holding every data file its ``.metadata`` names is loaded with
  ``torch.distributed.checkpoint`` into an empty state dict (torch installed); a part of a
  multi-part DCP checkpoint holds only its own data files, which the trainer's sharded state
  dict loads, so there the bytes are what is checked (said in ``LoadCheck.loader``);
- any other folder has only its bytes to check.
A file that is missing, short or different, or a tensor the loader refuses, is
``CorruptCheckpoint(path=...)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.checksum import hash_file
from core.errors import CorruptCheckpoint
from core.formats import DCP_METADATA, DTYPE_BITS


@dataclass(frozen=True)
class ManifestFile:
    path: str
    size: int
    checksum: str  # crc32c hex


@dataclass(frozen=True)
class LoadCheck:
    """What was loaded: bytes read (all files, in full), tensors materialised, and by what."""

    bytes: int
    tensors: int
    loader: str


def load_and_check(folder: str | Path, files: Sequence[ManifestFile], fmt: str) -> LoadCheck:
    """See the module contract."""
    root = Path(folder)
    total = 0
    for f in files:
        p = root / f.path
        if not p.is_file():
            raise CorruptCheckpoint(f"{f.path}: missing from {root}", path=f.path)
        size, crc = hash_file(p)
        if (size, crc) != (f.size, f.checksum):
            raise CorruptCheckpoint(f"{f.path}: {size} bytes crc32c {crc}, manifest {f.size} bytes {f.checksum}",
                                    path=f.path)
        total += size
    shards = [f.path for f in files if f.path.endswith(".safetensors")]
    if fmt in ("safetensors", "hf-sharded") or (shards and fmt == "folder"):
        tensors, loader = _load_safetensors(root, shards)
        return LoadCheck(total, tensors, loader)
    if fmt == "dcp":
        return _load_dcp(root, files, total)
    return LoadCheck(total, 0, "bytes only")


def framework() -> str:
    """The safetensors framework tensors are loaded into: torch where installed (imported
    here, as a trainer has it imported), else numpy."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "pt"


def _load_safetensors(root: Path, shards: Sequence[str]) -> tuple[int, str]:
    from safetensors import safe_open

    fw = framework()
    count = 0
    for rel in shards:
        try:
            with safe_open(str(root / rel), framework=fw) as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                    _check_tensor(rel, name, fh.get_slice(name), fh.get_tensor(name))
                    count += 1
        except CorruptCheckpoint:
            raise
        except Exception as exc:
            raise CorruptCheckpoint(f"{rel}: safetensors refused it: {type(exc).__name__}: {exc}", path=rel) from exc
    return count, f"safetensors ({'torch' if fw == 'pt' else 'numpy'})"


def _check_tensor(rel: str, name: str, sl: Any, tensor: Any) -> None:
    dtype, shape = sl.get_dtype(), list(sl.get_shape())
    want = math.ceil(math.prod(shape) * DTYPE_BITS.get(dtype, 0) / 8)
    got = tensor.nbytes if hasattr(tensor, "nbytes") else tensor.numel() * tensor.element_size()
    if list(tensor.shape) != shape or (DTYPE_BITS.get(dtype) and got != want):
        raise CorruptCheckpoint(f"{rel}: tensor {name} loaded as {list(tensor.shape)} ({got} bytes), header says "
                                f"{dtype}{shape} ({want} bytes)", path=rel)


def _load_dcp(root: Path, files: Sequence[ManifestFile], total: int) -> LoadCheck:
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:
        return LoadCheck(total, 0, "bytes only (torch not installed)")
    if not (root / DCP_METADATA).is_file():
        return LoadCheck(total, 0, "bytes only (no .metadata)")
    reader = dcp.FileSystemReader(str(root))
    meta = reader.read_metadata()
    needed = {item.relative_path for item in (meta.storage_data or {}).values()}
    if not needed <= {Path(f.path).name for f in files} | {p.name for p in root.glob("*.distcp")}:
        return LoadCheck(total, 0, "bytes only (a part of a sharded DCP checkpoint)")
    state: dict[str, Any] = {}
    try:
        # torch's own dcp_to_torch_save way to read a checkpoint without a model: the planner
        # builds the state dict from the metadata and fills it
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except Exception as exc:
        raise CorruptCheckpoint(f"{DCP_METADATA}: torch.distributed.checkpoint refused it: {exc}",
                                path=DCP_METADATA) from exc
    return LoadCheck(total, _count_tensors(state), "torch.distributed.checkpoint")


def _count_tensors(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_count_tensors(v) for v in tree.values())
    return 1 if hasattr(tree, "shape") else 0
