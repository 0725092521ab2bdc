"""Hostile or incomplete inputs the format checks must refuse: DCP metadata that is not a
torch ``Metadata``, multi-node checkpoints whose parts do not add up, and safetensors headers
whose verification would cost unbounded memory."""

from __future__ import annotations

import io
import json
import pickle
import re
import struct

import pytest

from core import formats
from core.errors import CorruptCheckpoint
from tests.kit.require import require_module


def mem_opener(files: dict[str, bytes]):
    from contextlib import contextmanager

    @contextmanager
    def opener(rel):
        yield io.BytesIO(files[rel])

    return opener


def check_dcp(metadata: bytes) -> None:
    files = {".metadata": metadata, "__0_0.distcp": bytes(8)}
    formats.validate("dcp", {k: len(v) for k, v in files.items()}, mem_opener(files))


# --- DCP .metadata must be a torch.distributed.checkpoint Metadata -------------------------
@pytest.mark.parametrize("obj", [None, {}, {"state_dict_metadata": {}}, ["__0_0.distcp"], "__0_0.distcp"],
                         ids=["None", "empty-dict", "plain-dict", "list", "str"])
@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_a_pickle_that_is_not_dcp_metadata_is_corrupt(obj, protocol):
    with pytest.raises(CorruptCheckpoint, match=re.escape("not a torch.distributed.checkpoint Metadata")):
        check_dcp(pickle.dumps(obj, protocol=protocol))


def test_dcp_metadata_of_an_empty_state_dict_is_corrupt():
    require_module("torch")
    from torch.distributed.checkpoint.metadata import Metadata

    with pytest.raises(CorruptCheckpoint, match="no tensor or bytes entry"):
        check_dcp(pickle.dumps(Metadata(state_dict_metadata={})))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_real_dcp_metadata_passes_in_every_pickle_protocol(tmp_path, protocol):
    torch = require_module("torch")
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(10.0), "opt": {"step": 3}}, checkpoint_id=str(tmp_path))
    meta = pickle.loads((tmp_path / ".metadata").read_bytes())  # our own file: safe to load here
    names = formats.dcp_referenced_files(pickle.dumps(meta, protocol=protocol), ".metadata")
    assert names == {p.name for p in tmp_path.iterdir() if p.name.endswith(".distcp")}


# --- safetensors headers: bounded like the safetensors library, memory ~ header size --------
def _many_tensors(n: int) -> bytes:
    entries, off = [], 0
    for i in range(n):
        entries.append(f'"model.layers.{i}.mlp.up_proj.weight":'
                       f'{{"dtype":"F32","shape":[1],"data_offsets":[{off},{off + 4}]}}')
        off += 4
    header = ("{" + ",".join(entries) + "}").encode()
    return struct.pack("<Q", len(header)) + header + bytes(off)


def test_verifying_a_header_of_many_tensors_costs_about_twice_its_size():
    """json.loads of a whole header built ~7x its size in objects (~630 MB RSS for an 86 MB
    header); entries are now parsed one by one and only their spans kept."""
    import tracemalloc

    data = _many_tensors(60_000)
    header_len = struct.unpack("<Q", data[:8])[0]
    tracemalloc.start()
    try:
        assert formats.validate_safetensors(io.BytesIO(data), len(data), "big.safetensors") == 60_000
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * header_len, f"peak {peak} bytes for a {header_len} byte header"


def test_header_length_bound_is_the_safetensors_library_s():
    class Huge(io.BytesIO):  # a file claiming to be large: the length prefix alone decides
        pass

    too_long = Huge(struct.pack("<Q", 100_000_001))
    with pytest.raises(CorruptCheckpoint, match="exceeds the 100000000 byte bound"):
        formats.validate_safetensors(too_long, 1 << 40, "m.safetensors")


def test_an_entry_too_long_for_any_real_tensor_is_refused_without_parsing_it():
    header = json.dumps({"a": {"dtype": "U8", "shape": [0] * 500_000, "data_offsets": [0, 0]}}).encode()
    data = struct.pack("<Q", len(header)) + header
    with pytest.raises(CorruptCheckpoint, match="longer than 4096 characters"):
        formats.validate_safetensors(io.BytesIO(data), len(data), "m.safetensors")


def test_header_padding_and_metadata_are_still_accepted():
    import numpy as np
    from safetensors.numpy import save

    data = save({"w": np.ones((3, 5), dtype=np.float16)}, metadata={"format": "pt", "note": "a } brace"})
    assert formats.validate_safetensors(io.BytesIO(data), len(data), "m.safetensors") == 1
