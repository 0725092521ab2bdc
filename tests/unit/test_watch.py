"""``ckpt watch`` commits and announces each complete checkpoint folder exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt.watch import Watcher, completion, step_of
from core import checksum
from core.manifest import Manifest
from tests.kit.require import require_module


def _hf_folder(path, shards=2, write=None):
    """A Hugging Face sharded folder; ``write`` limits which shard files exist yet."""
    path.mkdir(parents=True)
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    wm = {}
    for i, name in enumerate(names):
        if write is None or i in write:
            save_file({f"w{i}": np.full(1000, i, dtype=np.float32)}, str(path / name))
        wm[f"w{i}"] = name
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return path


def _watcher(settings, job_dir, **kw):
    return Watcher(job_dir, "run-w", settings, announce=False, **kw)


def _tier0_manifest(settings, step):
    p = settings.data_dir / "tier0" / "node-0" / "run-w" / f"step-{step:08d}" / "manifest.json"
    return Manifest.from_json(p.read_bytes()) if p.is_file() else None


def test_hf_folder_is_committed_once_complete_and_only_once(settings_factory, tmp_path):
    s = settings_factory()
    job = tmp_path / "job"
    ck = _hf_folder(job / "checkpoint-200", write={0})
    w = _watcher(s, job)
    assert w.poll() == []  # the index names a shard that is not there yet
    save_file({"w1": np.full(1000, 1, dtype=np.float32)}, str(ck / "model-00002-of-00002.safetensors"))
    saved = w.poll()
    assert [x.step for x in saved] == [200]
    m = _tier0_manifest(s, 200)
    assert m.format == "hf-sharded" and len(m.files) == 3 and m.writer_stall_seconds is None
    for f in m.files:
        assert checksum.hash_file(saved[0].path / f.path) == (f.size, f.checksum)
    assert w.poll() == []
    w.close()
    # a restarted watcher does not announce it again; the job's folder is untouched (linked)
    w2 = _watcher(s, job)
    assert w2.poll() == [] and w2.pending() == []
    w2.close()
    assert os.stat(ck / "model-00001-of-00002.safetensors").st_nlink == 2
    assert sorted(os.listdir(ck)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                      "model.safetensors.index.json"]


def _real_dcp(folder) -> None:
    """A DCP folder as torch writes it (a dict pickled as ``.metadata`` is not one)."""
    import warnings

    torch = require_module("torch")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(1024.0)}, checkpoint_id=str(folder))


def test_dcp_and_marker_folders(settings_factory, tmp_path):
    s = settings_factory()
    job = tmp_path / "job"
    dcp = job / "step-10"
    dcp.mkdir(parents=True)
    _real_dcp(dcp)
    custom = job / "global_step20"
    custom.mkdir()
    (custom / "weights.bin").write_bytes(b"x" * 100)
    (custom / "COMMITTED").write_text("")
    (job / "global_step30").mkdir()
    (job / "global_step30" / "weights.bin").write_bytes(b"half")  # no marker yet
    (job / "tmp-checkpoint-40").mkdir()
    (job / "tmp-checkpoint-40" / "COMMITTED").write_text("")
    (job / "logs").mkdir()
    w = _watcher(s, job)
    assert [x.step for x in w.poll()] == [10, 20]
    w.close()
    assert _tier0_manifest(s, 10).format == "dcp"
    m20 = _tier0_manifest(s, 20)
    assert [f.path for f in m20.files] == ["weights.bin"]  # the marker is the job's, not data


def test_a_bad_folder_is_skipped_and_the_watcher_goes_on(settings_factory, tmp_path):
    s = settings_factory()
    job = tmp_path / "job"
    bad = _hf_folder(job / "checkpoint-1", shards=1)
    (bad / "model-00001-of-00001.safetensors").write_bytes(b"\xff" * 64)  # hostile header
    _hf_folder(job / "checkpoint-2", shards=1)
    w = _watcher(s, job)
    assert [x.step for x in w.poll()] == [2]
    assert _tier0_manifest(s, 1) is None
    assert w.poll() == []  # not retried in a loop
    w.close()
    assert not any(n.startswith(".ckpt-staging") for n in os.listdir(s.data_dir / "tier0" / "node-0" / "run-w"))


def test_completion_and_step_rules(tmp_path):
    assert step_of("checkpoint-1200") == 1200 and step_of("global_step7") == 7 and step_of("step-00000042") == 42
    assert step_of("tmp-checkpoint-5") is None and step_of("logs") is None and step_of(".staging-3") is None
    assert step_of("checkpoint-\uff11\uff10\uff10") is None  # full-width digits are no step
    half = tmp_path / "c"
    half.mkdir()
    (half / "model.safetensors.index.json").write_text('{"weight_map": {"a": "s1.safetensors"')
    assert completion(half) is None  # index still being written


def test_cli_watch_once(settings_factory, tmp_path):
    settings_factory()  # clears CKPT_* and chdirs into tmp_path
    job = tmp_path / "job"
    _hf_folder(job / "checkpoint-3", shards=1)
    env = dict(os.environ, CKPT_DATA_DIR=str(tmp_path / "data"), CKPT_NODE="node-0",
               CKPT_CATALOG_URL=f"sqlite:///{tmp_path}/none/c.db")
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "ckpt.cli", "watch", str(job), "--run", "run-w", "--once"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "run-w step 3" in out.stdout
    assert (tmp_path / "data" / "tier0" / "node-0" / "run-w" / "step-00000003" / "manifest.json").is_file()


def test_real_torch_dcp_checkpoint_is_committed_and_loads_back(settings_factory, tmp_path):
    torch = require_module("torch")
    import torch.distributed.checkpoint as dcp

    s = settings_factory()
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
             "step": torch.tensor(5)}
    dcp.save(state, checkpoint_id=str(tmp_path / "job" / "step-5"))
    w = _watcher(s, tmp_path / "job")
    (saved,) = w.poll()
    w.close()
    m = saved.manifest
    assert m.format == "dcp" and ".metadata" in {f.path for f in m.files}
    for f in m.files:
        assert checksum.hash_file(saved.path / f.path) == (f.size, f.checksum)
    back = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=str(saved.path))  # from the Tier 0 copy
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and torch.equal(back["model"]["b"], state["model"]["b"])
    assert int(back["step"]) == 5


def test_watched_milestones_come_from_every_n_or_the_marker_file(settings_factory, tmp_path):
    settings = settings_factory()
    job = tmp_path / "job"
    for step in (100, 150, 200):
        _hf_folder(job / f"checkpoint-{step}")
    (job / "checkpoint-150" / "MILESTONE").write_text("")
    w = _watcher(settings, job, milestone_every=100)
    w.poll()
    w.close()
    kinds = {s: _tier0_manifest(settings, s).kind for s in (100, 150, 200)}
    assert kinds == {100: "milestone", 150: "milestone", 200: "milestone"}
    assert "MILESTONE" not in [f.path for f in _tier0_manifest(settings, 150).files]

    plain = settings_factory(data_dir=tmp_path / "other")
    _hf_folder(tmp_path / "job2" / "checkpoint-150")
    w = Watcher(tmp_path / "job2", "run-w", plain, announce=False, milestone_every=100)
    w.poll()
    w.close()
    m = Manifest.from_json((plain.data_dir / "tier0" / "node-0" / "run-w" / "step-00000150" / "manifest.json")
                           .read_bytes())
    assert m.kind == "step"


def test_cli_watch_records_the_run_origin_in_every_manifest(settings_factory, tmp_path):
    settings_factory()  # clears CKPT_* and chdirs into tmp_path
    job = tmp_path / "job"
    for step in (300, 400):
        _hf_folder(job / f"checkpoint-{step}", shards=1)
    env = dict(os.environ, CKPT_DATA_DIR=str(tmp_path / "data"), CKPT_NODE="node-0",
               CKPT_CATALOG_URL=f"sqlite:///{tmp_path}/none/c.db")
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "ckpt.cli", "watch", str(job), "--run", "run-w", "--once",
                          "--fine-tuned-from", "base/200"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for step in (300, 400):
        m = Manifest.from_json((tmp_path / "data" / "tier0" / "node-0" / "run-w" / f"step-{step:08d}"
                                / "manifest.json").read_bytes())
        assert (m.parent.run, m.parent.step, m.parent.relation) == ("base", 200, "fine_tuned_from")


def test_an_unmounted_tier0_is_never_written_on_and_the_folder_waits_for_it(settings_factory, tmp_path):
    """A configured Tier 0 whose mount is missing: neither the watcher nor ``ckpt commit``
    makes its root or anything under it; the watcher tries the folder again at its next poll
    and commits it once the mount (with its identity marker) is back."""
    from ckpt.commit import commit_folder
    from core.errors import TierUnavailable
    from tests.kit.settings import mark_root

    nvme = tmp_path / "nvme"
    s = settings_factory(tier0_url=str(nvme))
    job = tmp_path / "job"
    _hf_folder(job / "checkpoint-1", shards=1)
    w = _watcher(s, job)
    assert w.poll() == []
    with pytest.raises(TierUnavailable, match="does not exist"):
        commit_folder(job / "checkpoint-1", "run-w", 1, s, announce=False)
    assert not nvme.exists()
    nvme.mkdir()
    mark_root(nvme)  # the mount is back
    assert [x.step for x in w.poll()] == [1]
    w.close()
    assert (nvme / "run-w" / "step-00000001" / "manifest.json").is_file()
