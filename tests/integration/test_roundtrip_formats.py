"""Real checkpoint formats make the whole round trip: written by the framework, promoted to all
three tiers, pruned from Tier 0 and Tier 1, restored from Tier 2 (moto's S3 server over HTTP)
and loaded back by the framework, equal to the original. Then the failures a replacement node
meets: Tier 0 gone, Tier 1 rotten, no good copy of the newest checkpoint at all. Catalogs on
SQLite and PostgreSQL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.restore import restore_checkpoint
from tests.kit.checkpoints import flip_bit, replica_states
from tests.kit.require import require_module
from tests.kit.restore import commit_folder, promote, prune, scenario_settings, tier0_dir, tier1_dir
from tests.kit.s3 import corrupt_s3_object

torch = require_module("torch", "the torch extra (pip install -e '.[torch]')")

pytestmark = pytest.mark.slow


@pytest.fixture
def settings(settings_factory, db_url, s3_endpoint, s3_bucket):
    return scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)


# --- the two formats, written and read by their own libraries --------------------------------
def make_model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                               torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save_dcp(model, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "extra": {"step": torch.tensor(7)}}, checkpoint_id=str(folder))


def load_dcp(folder: Path) -> dict:
    """Load into a differently initialised model with ``dcp.load``, as a resumed job would."""
    import torch.distributed.checkpoint as dcp

    fresh = make_model(seed=12345)
    target = {"model": fresh.state_dict(), "extra": {"step": torch.tensor(0)}}
    dcp.load(target, checkpoint_id=str(folder))
    fresh.load_state_dict(target["model"])
    assert int(target["extra"]["step"]) == 7
    return state_of(fresh)


def save_hf(model, folder: Path, shards: int = 3) -> None:
    """Hugging Face layout: ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    names = list(model.state_dict())
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: model.state_dict()[n].contiguous() for n in names[i::shards]}
        save_file(chunk, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, fname))
        total += sum(t.numel() * t.element_size() for t in chunk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps({"architectures": ["Tiny"], "hidden_size": 64}))


def load_hf(folder: Path) -> dict:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    state: dict = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(folder / shard)))
    assert set(state) == set(index["weight_map"])
    fresh = make_model(seed=999)
    fresh.load_state_dict(state)
    return state_of(fresh)


FORMATS = {"dcp": (save_dcp, load_dcp), "hf-sharded": (save_hf, load_hf)}


def checkpoint(settings, tmp_path: Path, run: str, step: int, fmt: str, seed: int, *, milestone: bool) -> dict:
    """Train-side: the framework writes the checkpoint, it is committed on Tier 0 and promoted."""
    model = make_model(seed)
    written = tmp_path / f"written-{run}-{step}"
    FORMATS[fmt][0](model, written)
    commit_folder(settings, run, step, folder=written, milestone=milestone)
    promote(settings, run, step)
    return state_of(model)


# --- the round trip ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_saved_promoted_pruned_restored_from_tier2_and_loaded_back_equal(settings, tmp_path, fmt):
    run = f"rt-{fmt}"
    original = checkpoint(settings, tmp_path, run, 100, fmt, seed=1, milestone=True)
    checkpoint(settings, tmp_path, run, 200, fmt, seed=2, milestone=False)  # 100 is no longer the newest
    assert replica_states(settings, run, 100) == {(0, 0): "verified", (1, 0): "verified", (2, 0): "verified"}

    prune(settings, run, 100, tier=0)
    prune(settings, run, 100, tier=1)
    assert replica_states(settings, run, 100) == {(0, 0): "pruned", (1, 0): "pruned", (2, 0): "verified"}
    assert not tier0_dir(settings, run, 100).exists() and not tier1_dir(settings, run, 100).exists()

    dest = tmp_path / "restored"
    report = restore_checkpoint(settings, run, dest, step=100)

    assert (report.step, report.tiers, report.notes) == (100, [2], [])
    from core.manifest import Manifest

    assert Manifest.from_json((dest / "manifest.json").read_bytes()).format == fmt
    assert same_state(FORMATS[fmt][1](dest), original)


def test_tier0_gone_and_tier1_corrupt_restores_from_tier2(settings, tmp_path):
    run = "rt-faults"
    original = checkpoint(settings, tmp_path, run, 100, "dcp", seed=3, milestone=True)
    shutil.rmtree(tier0_dir(settings, run, 100))  # the node died with its NVMe
    flip_bit(next(tier1_dir(settings, run, 100).glob("*.distcp")), 4096)

    report = restore_checkpoint(settings, run, tmp_path / "r")

    assert (report.step, report.tiers) == (100, [2])
    assert same_state(load_dcp(tmp_path / "r"), original)
    assert replica_states(settings, run, 100) == {(0, 0): "missing", (1, 0): "corrupt", (2, 0): "verified"}
    assert [b.tier for b in report.bad] == [0, 1]


def test_newest_without_a_good_copy_anywhere_falls_back_to_the_previous_and_says_so(settings, tmp_path):
    run = "rt-fallback"
    previous = checkpoint(settings, tmp_path, run, 100, "hf-sharded", seed=4, milestone=True)
    checkpoint(settings, tmp_path, run, 200, "hf-sharded", seed=5, milestone=True)
    shutil.rmtree(tier0_dir(settings, run, 200))
    flip_bit(tier1_dir(settings, run, 200) / "model-00002-of-00003.safetensors", -3)
    corrupt_s3_object(settings, run, 200, "model-00002-of-00003.safetensors")

    report = restore_checkpoint(settings, run, tmp_path / "r")

    assert (report.step, report.fell_back_from) == (100, 200), report.notes
    assert report.notes[-1] == "fell back from step 200 to step 100"
    assert any("tier 2 copy is corrupt" in n and "model-00002-of-00003.safetensors" in n for n in report.notes)
    assert same_state(load_hf(tmp_path / "r"), previous)
    assert replica_states(settings, run, 200) == {(0, 0): "missing", (1, 0): "corrupt", (2, 0): "corrupt"}


def test_an_unreachable_tier_is_not_a_reason_to_restore_older_state(settings, tmp_path):
    from ckpt.processes import free_port
    from core.errors import StorageUnavailable

    run = "rt-down"
    checkpoint(settings, tmp_path, run, 100, "hf-sharded", seed=6, milestone=True)
    checkpoint(settings, tmp_path, run, 200, "hf-sharded", seed=7, milestone=True)
    shutil.rmtree(tier0_dir(settings, run, 200))
    flip_bit(tier1_dir(settings, run, 200) / "config.json", 0)
    down = settings.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{free_port()}"})

    with pytest.raises(StorageUnavailable, match=r"not falling back|unreachable"):  # never an older checkpoint
        restore_checkpoint(down, run, tmp_path / "r")

    assert not (tmp_path / "r").exists()
    assert replica_states(settings, run, 200)[(2, 0)] == "verified"  # unreachable is not corrupt
