"""Format detection and validation: real safetensors files (written by the safetensors
library), HF sharded indexes, DCP folders, and hostile headers that must end in a clear
``CorruptCheckpoint``, never a crash, a hang or a huge allocation."""

from __future__ import annotations

import io
import json
import pickle
import random
import re
import struct
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save, save_file

from core import formats
from core.errors import CorruptCheckpoint
from tests.kit.require import require_module


def mem_opener(files: dict[str, bytes]):
    @contextmanager
    def opener(rel):
        yield io.BytesIO(files[rel])

    return opener


def check(files: dict[str, bytes], fmt: str | None = None, complete: bool = True) -> str:
    fmt = fmt or formats.detect_format(list(files))
    formats.validate(fmt, {k: len(v) for k, v in files.items()}, mem_opener(files), complete=complete)
    return fmt


def st_bytes(header: dict | bytes, data: bytes = b"", pad_len: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(h) if pad_len is None else pad_len
    return struct.pack("<Q", n) + h + data


GOOD = save({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, dtype=np.int64)},
            metadata={"format": "pt"})


def test_real_safetensors_file_is_valid():
    assert check({"model.safetensors": GOOD}) == "safetensors"
    assert formats.validate_safetensors(io.BytesIO(GOOD), len(GOOD), "m") == 2


def test_bf16_and_empty_tensors_are_valid():
    hdr = {"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
           "e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [8, 8]}}
    data = st_bytes(hdr, b"\0" * 8)
    assert check({"x.safetensors": data}) == "safetensors"
    assert formats.validate_safetensors(io.BytesIO(data), len(data), "x.safetensors") == 2  # both counted


def test_detect_format():
    assert formats.detect_format(["model.safetensors"]) == "safetensors"
    assert formats.detect_format(["model.safetensors.index.json", "a.safetensors", "b.safetensors"]) == "hf-sharded"
    assert formats.detect_format([".metadata", "__0_0.distcp"]) == "dcp"
    assert formats.detect_format(["a.safetensors", "b.safetensors"]) == "folder"
    assert formats.detect_format(["optimizer.pt", "config.json"]) == "folder"


HOSTILE = {
    "length beyond any bound": struct.pack("<Q", 2**63) + b"{}",
    "length beyond the file": struct.pack("<Q", 90 * 1024 * 1024) + b"{}",
    "shorter than the length prefix": b"\x01\x02",
    "not utf-8": st_bytes(b"\xff\xfe{}"),
    "not json": st_bytes(b"{not json"),
    "json array": st_bytes(b"[1, 2]"),
    "deeply nested": st_bytes(b"[" * 200_000 + b"]" * 200_000),
    "unknown dtype": st_bytes({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
    "negative dim": st_bytes({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
    "float dim": st_bytes({"a": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}}, b"\0"),
    "bool offsets": st_bytes({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, b"\0"),
    "offset past the end": st_bytes({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 2),
    "begin after end": st_bytes({"a": {"dtype": "U8", "shape": [0], "data_offsets": [2, 1]}}, b"\0" * 2),
    "span != dtype x shape": st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    "absurd shape": st_bytes({"a": {"dtype": "U8", "shape": [2**62, 2**62, 2**62], "data_offsets": [0, 1]}}, b"\0"),
    "overlap": st_bytes({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6),
    "gap": st_bytes({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                     "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, b"\0" * 6),
    "trailing bytes": st_bytes({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 5),
    "entry not an object": st_bytes({"a": [1, 2, 3]}),
    "metadata not str": st_bytes({"__metadata__": {"k": 1}}),
    "offsets wrong length": st_bytes({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 1, 2]}}, b"\0" * 2),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_header_is_a_clear_corrupt_verdict(name):
    with pytest.raises(CorruptCheckpoint) as exc:
        check({"model.safetensors": HOSTILE[name]})
    assert exc.value.path == "model.safetensors"
    assert "model.safetensors" in str(exc.value)


def test_oversized_header_length_reads_nothing_big():
    """A length prefix of 90 MB in a small file fails before any allocation or read."""
    reads = []

    class Spy(io.BytesIO):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

    with pytest.raises(CorruptCheckpoint, match="exceeds the file size"):
        formats.validate_safetensors(Spy(HOSTILE["length beyond the file"]), 10, "m")
    assert reads == [8]


def test_fuzz_random_and_mutated_headers_never_crash():
    rng = random.Random(1234)
    samples = [GOOD, HOSTILE["gap"], HOSTILE["overlap"]]
    outcomes = {"ok": 0, "corrupt": 0}
    for i in range(1500):
        base = bytearray(rng.choice(samples))
        kind = i % 3
        if kind == 0:  # flip random bytes anywhere, header included
            for _ in range(rng.randint(1, 4)):
                base[rng.randrange(len(base))] = rng.randrange(256)
        elif kind == 1:  # random header bytes under a plausible length prefix
            body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
            base = bytearray(struct.pack("<Q", len(body)) + body)
        else:  # random JSON-ish tokens
            toks = ['{', '}', '[', ']', '"a"', ':', ',', '0', '-1', '1e400', '"F32"', '"dtype"',
                    '"shape"', '"data_offsets"', 'null', 'true', '18446744073709551615']
            body = "".join(rng.choice(toks) for _ in range(rng.randint(1, 40))).encode()
            base = bytearray(struct.pack("<Q", len(body)) + body + bytes(rng.randint(0, 8)))
        try:
            formats.validate_safetensors(io.BytesIO(bytes(base)), len(base), "fuzz.safetensors")
            outcomes["ok"] += 1
        except CorruptCheckpoint as exc:
            assert exc.path == "fuzz.safetensors"
            outcomes["corrupt"] += 1
    assert outcomes["corrupt"] > 1000  # almost every mutation is caught


def hf_folder(tmp_path: Path, shards: int = 3) -> dict[str, bytes]:
    files, wm = {}, {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        files[name] = save({f"layer{i}.w": np.full((4, 4), i, dtype=np.float16)})
        wm[f"layer{i}.w"] = name
    files[formats.HF_INDEX] = json.dumps({"metadata": {"total_size": 96}, "weight_map": wm}).encode()
    return files


def test_hf_sharded_valid(tmp_path):
    assert check(hf_folder(tmp_path)) == "hf-sharded"


def test_hf_sharded_missing_shard(tmp_path):
    files = hf_folder(tmp_path)
    del files["model-00002-of-00003.safetensors"]
    with pytest.raises(CorruptCheckpoint, match="missing shard") as exc:
        check(files)
    assert exc.value.path == "model-00002-of-00003.safetensors"
    assert check(files, "hf-sharded", complete=False) == "hf-sharded"  # one part of many: others hold the shard


def test_hf_sharded_bad_index_and_bad_shard(tmp_path):
    files = hf_folder(tmp_path)
    with pytest.raises(CorruptCheckpoint, match="weight_map"):
        check({**files, formats.HF_INDEX: b'{"weight_map": [1]}'})
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        check({**files, formats.HF_INDEX: b"{{"})
    with pytest.raises(CorruptCheckpoint) as exc:
        check({**files, "model-00001-of-00003.safetensors": HOSTILE["gap"]})
    assert exc.value.path == "model-00001-of-00003.safetensors"


def test_hf_index_missing(tmp_path):
    files = hf_folder(tmp_path)
    del files[formats.HF_INDEX]
    with pytest.raises(CorruptCheckpoint, match="missing"):
        check(files, "hf-sharded")


def dcp_files(ranks: int = 2) -> dict[str, bytes]:
    """A DCP folder in memory: a real ``Metadata`` pickle (torch's classes) and its data files."""
    torch_dcp = require_module("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    storage = {MetadataIndex(f"w{r}"): _StorageInfo(f"__{r}_0.distcp", 0, 64) for r in range(ranks)}
    meta = torch_dcp.metadata.Metadata(state_dict_metadata={f"w{r}": BytesStorageMetadata() for r in range(ranks)},
                                       storage_data=storage)
    assert isinstance(meta, Metadata)
    files = {".metadata": pickle.dumps(meta)}
    for r in range(ranks):
        files[f"__{r}_0.distcp"] = bytes(64)
    return files


def test_dcp_valid():
    assert check(dcp_files()) == "dcp"
    assert formats.dcp_referenced_files(dcp_files()[".metadata"], ".metadata") == {"__0_0.distcp", "__1_0.distcp"}


def test_dcp_missing_or_empty_data_file():
    files = dcp_files()
    del files["__1_0.distcp"]
    with pytest.raises(CorruptCheckpoint, match="missing data file") as exc:
        check(files, "dcp")
    assert exc.value.path == "__1_0.distcp"
    files = dcp_files()
    files["__0_0.distcp"] = b""
    with pytest.raises(CorruptCheckpoint, match="empty"):
        check(files, "dcp")


def test_dcp_missing_or_garbage_metadata():
    files = dcp_files()
    del files[".metadata"]
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata is missing"):
        check(files, "dcp")
    with pytest.raises(CorruptCheckpoint, match="pickle"):
        check({**dcp_files(), ".metadata": b"\x80\x05garbage"}, "dcp")


def test_dcp_metadata_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    files = {".metadata": pickle.dumps(Evil()), "__0_0.distcp": b"x"}
    with pytest.raises(CorruptCheckpoint, match=re.escape("not a torch.distributed.checkpoint Metadata")):
        check(files, "dcp")
    assert not marker.exists()


def test_local_folder_round_trip(tmp_path):
    """Tensors saved to a folder are listed with their sizes, validate as what they are, and read
    back equal; the same folder with a shard cut short no longer validates."""
    from safetensors.numpy import load_file

    from core.manifest_build import list_checkpoint_files, local_opener

    saved = {"a": np.arange(4, dtype=np.float32), "b": np.full((2, 3), 7, dtype=np.int16)}
    save_file(saved, str(tmp_path / "model.safetensors"))
    sizes = list_checkpoint_files(tmp_path)
    assert sizes == {"model.safetensors": (tmp_path / "model.safetensors").stat().st_size}
    assert formats.detect_format(list(sizes)) == "safetensors"
    formats.validate("safetensors", sizes, local_opener(tmp_path))
    with local_opener(tmp_path)("model.safetensors") as fh:
        assert formats.validate_safetensors(fh, sizes["model.safetensors"], "model.safetensors") == 2
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(loaded) == ["a", "b"]
    for name, array in saved.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array)

    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(CorruptCheckpoint, match=re.escape("model.safetensors")):
        formats.validate("safetensors", list_checkpoint_files(tmp_path), local_opener(tmp_path))


def test_real_torch_dcp_folder_is_parsed_without_unpickling(tmp_path):
    torch = require_module("torch")
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(10.0), "b": torch.ones(3, 3)}, checkpoint_id=str(tmp_path))
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert formats.dcp_referenced_files(files[".metadata"], ".metadata") == {n for n in files if n.endswith(".distcp")}
    assert check(files) == "dcp"
    del files["__0_0.distcp"]
    with pytest.raises(CorruptCheckpoint, match="missing data file"):
        check(files, "dcp")
