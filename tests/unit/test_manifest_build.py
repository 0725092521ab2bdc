"""Manifest building, atomic writing and reading back; the CRC32C spellings it relies on."""

from __future__ import annotations

import io
import os

import crc32c
import numpy as np
import pytest
from safetensors.numpy import save_file

from core import checksum
from core.errors import BadInput, ConflictError, CorruptCheckpoint, NotFound, PathEscape
from core.layout import staging_name
from core.manifest import Manifest
from core.manifest_build import build_manifest, read_manifest, write_manifest
from core.storage.local import LocalStore


def test_crc32c_spellings_match_the_standard_check_value():
    # CRC-32C("123456789") = 0xE3069283 (RFC 3720, iSCSI)
    assert checksum.hash_bytes(b"123456789") == "e3069283"
    assert checksum.hex_to_s3("e3069283") == "4waSgw=="
    assert checksum.s3_to_hex("4waSgw==") == "e3069283"
    assert checksum.s3_to_hex("4waSgw==-3") is None  # composite multipart checksum
    assert checksum.s3_to_hex("not base64!") is None


def test_hash_stream_same_with_and_without_readinto(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)

    class NoReadinto:
        def __init__(self, b):
            self._b = io.BytesIO(b)

        def read(self, n):
            return self._b.read(n)

    expected = (len(data), f"{crc32c.crc32c(data):08x}")
    assert checksum.hash_stream(io.BytesIO(data), 1024 * 1024) == expected
    assert checksum.hash_stream(NoReadinto(data), 1024 * 1024) == expected
    sunk = bytearray()
    checksum.hash_stream(io.BytesIO(data), 1024 * 1024, sink=sunk.extend)
    assert bytes(sunk) == data


def make_hf_checkpoint(folder, shards=4):
    folder.mkdir(parents=True, exist_ok=True)
    wm = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"l{i}": np.random.default_rng(i).random((64, 64), dtype=np.float32)}, str(folder / name))
        wm[f"l{i}"] = name
    import json

    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return folder


def test_build_manifest_lists_every_file_with_size_and_crc(tmp_path):
    ck = make_hf_checkpoint(tmp_path / "ck")
    (ck / "sub").mkdir()
    (ck / "sub" / "optim.bin").write_bytes(os.urandom(10_000))
    m = build_manifest(ck, "run-a", 100, node="n0", kind="milestone", metrics={"loss": 1.5})
    assert m.format == "hf-sharded" and m.algorithm == "crc32c"
    assert [f.path for f in m.files] == sorted(
        [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
        + ["model.safetensors.index.json", "sub/optim.bin"]
    )
    for f in m.files:
        data = (ck / f.path).read_bytes()
        assert f.size == len(data)
        assert f.checksum == f"{crc32c.crc32c(data):08x}"


def test_write_manifest_is_the_atomic_commit_marker(tmp_path):
    ck = make_hf_checkpoint(tmp_path / "run-a" / "step-00000100")
    m = build_manifest(ck, "run-a", 100)
    path = write_manifest(ck, m)
    assert path.name == "manifest.json"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith(".")) == []  # no staging left
    store = LocalStore(tmp_path, tier=0)
    assert read_manifest(store, "run-a/step-00000100") == m
    write_manifest(ck, m)  # the same manifest again: a no-op
    other = build_manifest(ck, "run-a", 100, kind="epoch")
    with pytest.raises(ConflictError):
        write_manifest(ck, other)
    assert Manifest.from_json(path.read_bytes()) == m
    # the builder ignores its own manifest and staging leftovers
    (ck / staging_name("x.bin")).write_bytes(b"partial")
    assert build_manifest(ck, "run-a", 100).files == m.files


def test_multi_part_manifest_name(tmp_path):
    ck = make_hf_checkpoint(tmp_path / "ck", shards=2)
    (ck / "model.safetensors.index.json").unlink()
    m = build_manifest(ck, "r", 1, part=1, parts=2, fmt="hf-sharded")
    assert write_manifest(ck, m).name == "manifest.part-00001-of-00002.json"
    assert read_manifest(LocalStore(tmp_path, 0), "ck", 1, 2) == m
    with pytest.raises(NotFound):
        read_manifest(LocalStore(tmp_path, 0), "ck", 0, 2)


def test_build_refuses_corrupt_empty_and_escaping_folders(tmp_path):
    ck = make_hf_checkpoint(tmp_path / "ck", shards=2)
    with open(ck / "model-00001-of-00002.safetensors", "r+b") as fh:
        fh.write((10**9).to_bytes(8, "little"))  # header length past the end of the file
    with pytest.raises(CorruptCheckpoint) as exc:
        build_manifest(ck, "r", 1)
    assert exc.value.path == "model-00001-of-00002.safetensors"

    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput):
        build_manifest(tmp_path / "empty", "r", 1)

    (tmp_path / "outside.bin").write_bytes(b"secret")
    esc = tmp_path / "esc"
    esc.mkdir()
    (esc / "a.bin").write_bytes(b"a")
    os.symlink(tmp_path / "outside.bin", esc / "link.bin")
    with pytest.raises(PathEscape):
        build_manifest(esc, "r", 1)


def test_read_manifest_rejects_garbage(tmp_path):
    store = LocalStore(tmp_path, 1)
    store.write_small_atomic("r/step-00000001/manifest.json", b"{not json")
    with pytest.raises(CorruptCheckpoint):
        read_manifest(store, "r/step-00000001")
