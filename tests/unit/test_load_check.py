"""A drilled part is loaded with its format's own loader and checked against the manifest."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from core.checksum import hash_file
from core.errors import CorruptCheckpoint
from core.load_check import ManifestFile, load_and_check
from tests.kit.require import require_module


def listed(folder, *names):
    return [ManifestFile(n, *hash_file(folder / n)) for n in names]


def test_safetensors_shards_are_loaded_tensor_by_tensor(tmp_path):
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.int64)},
              str(tmp_path / "model-1.safetensors"))
    save_file({"c": np.zeros(7, dtype=np.float16)}, str(tmp_path / "model-2.safetensors"))
    (tmp_path / "rng.bin").write_bytes(b"state")
    files = listed(tmp_path, "model-1.safetensors", "model-2.safetensors", "rng.bin")

    got = load_and_check(tmp_path, files, "hf-sharded")

    assert got.tensors == 3 and got.loader.startswith("safetensors")
    assert got.bytes == sum(f.size for f in files)


def test_a_changed_byte_or_a_missing_file_is_corrupt(tmp_path):
    save_file({"a": np.arange(64, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    files = listed(tmp_path, "m.safetensors")
    data = bytearray((tmp_path / "m.safetensors").read_bytes())
    data[-3] ^= 1
    (tmp_path / "m.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="crc32c") as bad:
        load_and_check(tmp_path, files, "safetensors")
    assert bad.value.path == "m.safetensors"
    (tmp_path / "m.safetensors").unlink()
    with pytest.raises(CorruptCheckpoint, match="missing"):
        load_and_check(tmp_path, files, "safetensors")


def test_a_header_the_library_refuses_is_corrupt_even_when_the_bytes_match_the_manifest(tmp_path):
    (tmp_path / "m.safetensors").write_bytes((8).to_bytes(8, "little") + b'{"a": 1}')
    with pytest.raises(CorruptCheckpoint, match="safetensors refused it"):
        load_and_check(tmp_path, listed(tmp_path, "m.safetensors"), "safetensors")


def test_a_whole_dcp_checkpoint_is_loaded_with_torch(tmp_path):
    torch = require_module("torch")
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0), "opt": {"m": torch.ones(3)}}, checkpoint_id=str(tmp_path), no_dist=True)
    files = listed(tmp_path, *sorted(p.name for p in tmp_path.iterdir()))

    got = load_and_check(tmp_path, files, "dcp")

    assert (got.tensors, got.loader) == (2, "torch.distributed.checkpoint")
