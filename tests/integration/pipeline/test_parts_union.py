"""A checkpoint in several parts is complete only if its parts add up: every shard the HF
index names, every data file the DCP metadata names, is held by some part."""

from __future__ import annotations

import io
import json
import pickle
import re
from contextlib import contextmanager

import pytest

from core import formats
from core.checksum import hash_bytes
from core.errors import CorruptCheckpoint
from core.manifest import FileEntry, Manifest
from flows.common import plain_steps
from flows.promote import promote
from tests.kit.checkpoints import ckpt_dir, open_catalog as catalog, write_checkpoint
from tests.kit.pipeline import pipeline_settings
from tests.kit.require import require_module
from tests.kit.restore import on_node

RUN = "run-a"


def parts_of(layout: list[dict[str, bytes]], fmt: str) -> tuple[list[Manifest], dict[str, bytes]]:
    union: dict[str, bytes] = {}
    manifests = []
    for p, files in enumerate(layout):
        union.update(files)
        entries = tuple(FileEntry(path, len(data), hash_bytes(data)) for path, data in files.items())
        manifests.append(Manifest(run=RUN, step=1, files=entries, format=fmt, part=p, parts=len(layout)))
    return manifests, union


def opener_of(files: dict[str, bytes], reads: list[str] | None = None):
    @contextmanager
    def opener(rel):
        if reads is not None:
            reads.append(rel)
        yield io.BytesIO(files[rel])

    return opener


def check_union(layout, fmt, reads: list[str] | None = None):
    manifests, union = parts_of(layout, fmt)
    formats.check_union_complete(manifests, opener_of(union, reads))


def assert_complete(layout: list[dict[str, bytes]], fmt: str, *, index: str, referenced: list[str]) -> None:
    """The parts add up (the union check read ``index``), and each file the index refers to is
    needed: the same parts without it are corrupt, naming that file."""
    reads: list[str] = []
    check_union(layout, fmt, reads)
    assert index in reads, reads  # the verdict came from the index, not from a pass-through
    for gone in referenced:
        short = [{k: v for k, v in files.items() if k != gone} for files in layout]
        with pytest.raises(CorruptCheckpoint, match="that no part holds") as exc:
            check_union(short, fmt)
        assert exc.value.path == gone


def hf_index(*shards: str) -> bytes:
    return json.dumps({"weight_map": {f"t{i}": s for i, s in enumerate(shards)}}).encode()


def test_hf_parts_that_hold_every_indexed_shard_are_complete():
    assert_complete([{"model.safetensors.index.json": hf_index("a.safetensors", "b.safetensors"),
                      "a.safetensors": b"a"}, {"b.safetensors": b"b"}], "hf-sharded",
                    index="model.safetensors.index.json", referenced=["a.safetensors", "b.safetensors"])


def test_hf_shard_held_by_no_part_is_named():
    with pytest.raises(CorruptCheckpoint, match=re.escape("'c.safetensors' that no part holds")) as exc:
        check_union([{"model.safetensors.index.json": hf_index("a.safetensors", "c.safetensors"),
                      "a.safetensors": b"a"}, {"b.safetensors": b"b"}], "hf-sharded")
    assert exc.value.path == "c.safetensors"


def test_hf_index_in_no_part_or_in_two_different_copies_is_corrupt():
    with pytest.raises(CorruptCheckpoint, match="missing from every part"):
        check_union([{"a.safetensors": b"a"}, {"b.safetensors": b"b"}], "hf-sharded")
    with pytest.raises(CorruptCheckpoint, match="different copies"):
        check_union([{"model.safetensors.index.json": hf_index("a.safetensors")},
                     {"model.safetensors.index.json": hf_index("b.safetensors")}], "hf-sharded")


def dcp_metadata(*names: str) -> bytes:
    require_module("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    return pickle.dumps(Metadata(state_dict_metadata={n: BytesStorageMetadata() for n in names},
                                 storage_data={MetadataIndex(n): _StorageInfo(n, 0, 1) for n in names}))


def test_dcp_parts_are_complete_only_with_every_referenced_data_file():
    meta = dcp_metadata("__0_0.distcp", "__1_0.distcp")
    assert_complete([{".metadata": meta, "__0_0.distcp": b"0"}, {"__1_0.distcp": b"1"}], "dcp",
                    index=".metadata", referenced=["__0_0.distcp", "__1_0.distcp"])
    with pytest.raises(CorruptCheckpoint, match=re.escape("'__1_0.distcp' that no part holds")):
        check_union([{".metadata": meta, "__0_0.distcp": b"0"}, {"__2_0.distcp": b"2"}], "dcp")
    with pytest.raises(CorruptCheckpoint, match=re.escape(".metadata is missing from every part")):
        check_union([{"__0_0.distcp": b"0"}, {"__1_0.distcp": b"1"}], "dcp")


def test_identical_metadata_copies_in_several_parts_are_fine():
    meta = dcp_metadata("__0_0.distcp", "__1_0.distcp")
    assert_complete([{".metadata": meta, "__0_0.distcp": b"0"}, {".metadata": meta, "__1_0.distcp": b"1"}], "dcp",
                    index=".metadata", referenced=["__0_0.distcp", "__1_0.distcp"])
    other = dcp_metadata("__0_0.distcp", "__1_0.distcp", "__2_0.distcp")  # the copies must be the same bytes
    with pytest.raises(CorruptCheckpoint, match="parts 0 and 1 hold different copies"):
        check_union([{".metadata": meta, "__0_0.distcp": b"0"}, {".metadata": other, "__1_0.distcp": b"1"}], "dcp")


def test_a_two_node_checkpoint_missing_an_indexed_shard_never_becomes_durable(settings_factory, db_url):
    """Each part verifies alone; the index names a shard that neither node wrote."""
    settings = pipeline_settings(settings_factory, db_url)
    node1 = on_node(settings, "node-1")
    write_checkpoint(settings.tier0_url, RUN, 100, part=0, parts=2, node="node-0")
    write_checkpoint(node1.tier0_url, RUN, 100, part=1, parts=2, node="node-1", shards=1)  # one shard short

    promote(settings, RUN, 100, 0, 2, steps=plain_steps())
    with pytest.raises(CorruptCheckpoint, match=re.escape("'model-p01-00001.safetensors' that no part holds")):
        promote(node1, RUN, 100, 1, 2, steps=plain_steps())

    cat = catalog(settings)
    try:
        assert cat.get_checkpoint(RUN, 100).state == "corrupt"
        assert "complete" not in [e.action for e in cat.history(RUN, 100)]  # never complete on Tier 1
    finally:
        cat.close()
    assert (ckpt_dir(node1.tier0_url, RUN, 100) / "model-p01-00000.safetensors").is_file()  # nothing deleted
