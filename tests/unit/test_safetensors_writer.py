"""The safetensors writer: each shard's checksum, derived from its header's and its tensors'
CRC32Cs without hashing the write, is the CRC32C of the file as it lies on disk."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
from safetensors.numpy import load_file

from core import checksum, safetensors_writer as stw


def _arrays() -> dict[str, tuple[np.ndarray, str]]:
    rng = np.random.default_rng(7)
    tensors = {
        "embed": rng.standard_normal((300, 257), dtype=np.float32),  # larger than a piece below
        "norm": np.ones(7, dtype=np.float16),
        "empty": np.zeros((0, 4), dtype=np.float32),  # a 0 in its shape: no bytes
        "ids": np.arange(1001, dtype=np.int64),
        "mask": rng.integers(0, 2, 33).astype(bool),
    }
    return {k: stw.as_host_array(v) for k, v in tensors.items()}


@pytest.mark.parametrize("threads", [1, 3])
def test_each_tensors_crc32c_is_the_crc32c_of_its_bytes(monkeypatch, threads):
    monkeypatch.setattr(stw, "PIECE_BYTES", 4096)  # a tensor in many pieces, hashed on several threads
    arrays = _arrays()
    got = stw.tensor_crcs(arrays, buffer_bytes=1000, threads=threads)
    assert got == {k: crc32c.crc32c(a.tobytes()) for k, (a, _) in arrays.items()}


@pytest.mark.parametrize("hashed_first", [(), ("embed", "empty", "mask"), tuple(_arrays())])  # the rest as written
@pytest.mark.parametrize("shard_bytes", [1 << 30, 64 << 10, 1])  # one shard, a few, one tensor each
def test_every_shard_checksum_is_the_crc32c_of_the_file_written_and_it_loads_back(tmp_path, shard_bytes,
                                                                                  hashed_first):
    arrays = _arrays()
    crcs = stw.tensor_crcs({k: arrays[k] for k in hashed_first})
    written = stw.write_sharded(tmp_path, arrays, shard_bytes=shard_bytes, buffer_bytes=1000,
                                apart=["ids", "norm"], fsync=False, crcs=crcs)
    assert crcs == stw.tensor_crcs(arrays)  # those hashed as written are added

    for w in written:  # read back: the manifest's (size, CRC32C) are the bytes on disk
        assert checksum.hash_file(tmp_path / w.path) == (w.size, w.checksum), w.path
    loaded: dict[str, np.ndarray] = {}
    for w in written:
        if w.path.endswith(".safetensors"):
            loaded.update(load_file(str(tmp_path / w.path)))
    assert set(loaded) == set(arrays)
    for name, (a, _) in arrays.items():
        assert loaded[name].dtype == a.dtype and loaded[name].shape == a.shape
        assert np.array_equal(loaded[name], a), name


def test_the_tensors_a_written_shard_holds_again_are_found_from_its_header_alone(tmp_path):
    arrays = _arrays()
    written = stw.write_sharded(tmp_path, arrays, shard_bytes=1, fsync=False)  # one tensor a shard
    files = [(w.path, w.size, w.checksum) for w in written]
    assert stw.unchanged_files(tmp_path, files, arrays, stw.tensor_crcs(arrays)) == set(arrays)

    changed = dict(arrays, ids=stw.as_host_array(np.arange(1, 1002, dtype=np.int64)))
    assert stw.unchanged_files(tmp_path, files, changed, stw.tensor_crcs(changed)) == set(arrays) - {"ids"}
    reshaped = dict(arrays, ids=stw.as_host_array(np.arange(1001, dtype=np.int64).reshape(7, 143)))
    assert stw.unchanged_files(tmp_path, files, reshaped, stw.tensor_crcs(reshaped)) == set(arrays) - {"ids"}

    embed = next(path for path, _, _ in files if "embed" in (tmp_path / path).read_bytes()[:200].decode("latin-1"))
    with open(tmp_path / embed, "r+b") as fh:  # a header of JSON, not as written: nothing learned, no error
        length = int.from_bytes(fh.read(8), "little")
        fh.write(b'{"embed": {"data_offsets": [0, 1, 2]}}'.ljust(length))
    assert stw.unchanged_files(tmp_path, files, arrays, stw.tensor_crcs(arrays)) == set(arrays) - {"embed"}
