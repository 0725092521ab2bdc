"""``async_save_and_commit``: a real single-process ``dcp.async_save`` into Tier 0, committed and
promoted (plain functions, SQLite catalog), restored and loaded back with ``dcp.load``."""

from __future__ import annotations

import pytest

from tests.kit.require import require_module

torch = require_module("torch")

from tests.kit.restore import promote, scenario_settings  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_async_save_commits_after_the_write(settings_factory, sqlite_url, tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckpt.client import CheckpointStager
    from ckpt.integrations.dcp import async_save_and_commit
    from tasks.restore import restore_checkpoint

    settings = scenario_settings(settings_factory, sqlite_url, runs=("dcp-run",))
    sd = {"w": torch.randn(64, 64), "step": torch.tensor(7)}
    with CheckpointStager("dcp-run", settings=settings, announce=False) as stager:
        fut = async_save_and_commit(sd, stager, 7, metrics={"loss": 1.5})
        saved = fut.result(30)
    assert saved.step == 7 and saved.manifest.format == "dcp"
    assert saved.manifest.writer_stall_seconds == pytest.approx(fut.stall_seconds, abs=1e-5)
    assert not [p for p in saved.path.parent.iterdir() if p.name.startswith(".")], "no staging folder left"

    promote(settings, "dcp-run", 7)
    restore_checkpoint(settings, "dcp-run", tmp_path / "restored", step=7)
    back = {"w": torch.zeros(64, 64), "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=str(tmp_path / "restored"), no_dist=True)
    assert torch.equal(back["w"], sd["w"]) and int(back["step"]) == 7


def test_a_failed_commit_reaches_the_future(settings_factory, sqlite_url):
    from ckpt.client import CheckpointStager
    from ckpt.integrations.dcp import async_save_and_commit
    from core.errors import ConflictError

    settings = scenario_settings(settings_factory, sqlite_url, runs=("dcp-run",))
    with CheckpointStager("dcp-run", settings=settings, announce=False) as stager:
        async_save_and_commit({"w": torch.ones(4)}, stager, 1).result(30)
        again = async_save_and_commit({"w": torch.zeros(4)}, stager, 1)  # other bytes, same step
        with pytest.raises(ConflictError):
            again.result(30)
