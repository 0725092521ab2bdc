"""Hostile or incomplete inputs the format checks must refuse: DCP metadata that is not a
torch ``Metadata``, multi-node checkpoints whose parts do not add up, and safetensors headers
whose verification would cost unbounded memory."""

from __future__ import annotations

import io
import json
import pickle
import struct

import pytest

from core import formats
from core.errors import CorruptCheckpoint


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
    with pytest.raises(CorruptCheckpoint, match="not a torch.distributed.checkpoint Metadata"):
        check_dcp(pickle.dumps(obj, protocol=protocol))


def test_dcp_metadata_of_an_empty_state_dict_is_corrupt():
    pytest.importorskip("torch")
    from torch.distributed.checkpoint.metadata import Metadata

    with pytest.raises(CorruptCheckpoint, match="no tensor or bytes entry"):
        check_dcp(pickle.dumps(Metadata(state_dict_metadata={})))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_real_dcp_metadata_passes_in_every_pickle_protocol(tmp_path, protocol):
    torch = pytest.importorskip("torch")
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(10.0), "opt": {"step": 3}}, checkpoint_id=str(tmp_path))
    meta = pickle.loads((tmp_path / ".metadata").read_bytes())  # our own file: safe to load here
    names = formats.dcp_referenced_files(pickle.dumps(meta, protocol=protocol), ".metadata")
    assert names == {p.name for p in tmp_path.iterdir() if p.name.endswith(".distcp")}
