"""The Lightning integration with the real ``lightning`` Trainer: a tiny LightningModule trains a
few steps on CPU; ``TieringCheckpointIO`` commits each checkpoint ``ModelCheckpoint`` writes; the
real promotion and restore (plain functions, SQLite catalog) bring step N back; ``ckpt_path``
resumes from it and the resumed run's lineage points at it."""

from __future__ import annotations

import pytest

from tests.kit.require import require_module

require_module("lightning")

import torch  # noqa: E402

from tests.kit.restore import promote, scenario_settings, tier0_dir  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    # Lightning's own notes on what this test does on purpose (a new dirpath, a mid-epoch resume)
    # and a deprecation inside Lightning's pytree helper
    pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:You're resuming from a checkpoint",
                                "ignore:.*LeafSpec.*is deprecated"),
]


def _module():
    from tests.kit.lightning import tiny_module

    return tiny_module()


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(out, io, max_steps: int, callbacks=()):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    mc = ModelCheckpoint(dirpath=str(out), every_n_train_steps=2, save_top_k=-1, save_last=True)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(out), callbacks=[mc, *callbacks],
                     plugins=[io])


def test_lightning_checkpoints_commit_restore_and_resume(settings_factory, sqlite_url, tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import Callback

    from ckpt.integrations.lightning import TieringCheckpointIO
    from core.manifest import Manifest
    from db.catalog import Catalog
    from tasks.restore import restore_checkpoint

    monkeypatch.setenv("PREFECT_API_URL", "")  # no Prefect server: the announcer registers the run, sends nothing
    settings = scenario_settings(settings_factory, sqlite_url)

    io = TieringCheckpointIO(run="lit-run", settings=settings)
    _trainer(tmp_path / "out", io, max_steps=4).fit(_module(), _loader())
    assert [f.result().step for f in io.saved] == [2, 4]
    ck4 = tier0_dir(settings, "lit-run", 4)
    manifest = Manifest.from_json((ck4 / "manifest.json").read_bytes())
    [ckpt_file] = [f.path for f in manifest.files]
    assert ckpt_file.endswith(".ckpt") and manifest.writer_stall_seconds == pytest.approx(io.stalls[4], abs=1e-5)
    assert (tmp_path / "out" / ckpt_file).is_file(), "Lightning's own file stays where ModelCheckpoint put it"
    assert (tmp_path / "out" / "last.ckpt").is_file()

    promote(settings, "lit-run", 4)
    restored = tmp_path / "restored"
    restore_checkpoint(settings, "lit-run", restored, step=4)

    seen: list[int] = []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, *_args):
            seen.append(trainer.global_step)

    io2 = TieringCheckpointIO(run="lit-run-2", settings=settings, resumed_from=restored / ckpt_file)
    assert io2.origin == ("lit-run", 4)
    _trainer(tmp_path / "out2", io2, max_steps=6, callbacks=[Steps()]).fit(
        _module(), _loader(), ckpt_path=str(restored / ckpt_file))
    assert seen == [4, 5], "resumed at step 4, trained two more steps"
    assert [f.result().step for f in io2.saved] == [6]

    promote(settings, "lit-run-2", 6)
    with Catalog(settings.catalog_url) as cat:
        edges = cat.ancestors("lit-run-2", 6)
    assert [(e.parent_run, e.parent_step, e.relation) for e in edges] == [("lit-run", 4, "resumed_from")]


def test_two_ranks_of_a_non_sharded_strategy_are_refused_before_training(settings_factory, sqlite_url, tmp_path,
                                                                         monkeypatch):
    """Two ranks (two nodes, each its own Tier 0 and ``ModelCheckpoint`` folder), each plugin
    created as the part of its rank: both would commit ``epoch=0-step=N.ckpt``, so the second part
    could never sit beside the first on Tier 1 and no step would ever be durable. The plugin
    refuses the request at once, on the training side, before a step is trained or written."""
    from ckpt.integrations.lightning import TieringCheckpointIO
    from core.errors import BadInput

    monkeypatch.setenv("PREFECT_API_URL", "")
    settings = scenario_settings(settings_factory, sqlite_url)
    for rank in (0, 1):
        node = settings.model_copy(update={"node": f"node-{rank}",
                                           "tier0_url": str(tmp_path / "tier0" / f"node-{rank}")})
        with pytest.raises(BadInput, match=r"single-part checkpoints .* part=\d, parts=2"):
            io = TieringCheckpointIO(run="lit-ddp", settings=node, part=rank, parts=2)
            _trainer(tmp_path / f"out-{rank}", io, max_steps=2).fit(_module(), _loader())
        assert not (tmp_path / f"out-{rank}").exists(), "nothing trained, nothing written"
        assert not (tmp_path / "tier0" / f"node-{rank}" / "lit-ddp").exists()


def test_two_nodes_of_a_sharded_strategy_each_commit_their_part(settings_factory, sqlite_url, tmp_path):
    """Two nodes (two processes, gloo) save distributed checkpoints with ``ModelParallelStrategy``
    into one shared folder (``__0_0.distcp`` and ``__1_0.distcp``, ``.metadata`` and ``meta.pt``
    from rank 0): each node commits the files of its own ranks as its part, so the parts never
    share a path, and every part of both steps is verified on Tier 1. Both steps were saved into
    ``last.ckpt``: step 4's write left step 2's committed bytes as they were."""
    from db.catalog import Catalog
    from tests.kit.checkpoints import replica_states
    from tests.kit.lightning import run_nodes
    from tests.kit.restore import on_node, tier1_dir

    settings = scenario_settings(settings_factory, sqlite_url)
    nodes = [on_node(settings, f"node-{rank}") for rank in (0, 1)]
    done = run_nodes("tests.kit.lightning_sharded_job", [str(tmp_path / "out")], nodes)
    assert [rc for rc, _ in done] == [0, 0], done[0][1][-3000:] + done[1][1][-3000:]
    assert all("committed [2, 4]" in out for _, out in done)

    for step in (2, 4):
        for rank, node in enumerate(nodes):
            promote(node, "lit-sharded", step, rank, 2)
        assert replica_states(settings, "lit-sharded", step) == {
            (0, 0): "verified", (0, 1): "verified", (1, 0): "verified", (1, 1): "verified"}
        with Catalog(settings.catalog_url) as cat:
            ck = cat.get_checkpoint("lit-sharded", step)
            assert ck.state == "committed" and cat.rejections("lit-sharded") == []
            by_part = {p: sorted(f.path for f in cat.files(ck.id, p)) for p in (0, 1)}
        assert by_part == {0: [".metadata", "__0_0.distcp", "meta.pt"], 1: ["__1_0.distcp"]}
        on_tier1 = sorted(p.name for p in tier1_dir(settings, "lit-sharded", step).iterdir()
                          if not p.name.startswith("manifest"))
        assert on_tier1 == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


def test_a_sharded_strategy_that_would_save_one_file_or_a_chosen_part_is_refused():
    """Sharding off, these strategies save one ``.ckpt`` from global rank 0 (``TieringCheckpointIO``'s
    case); and a sharded checkpoint's part is its node's, never the caller's choice."""
    from ckpt.integrations.lightning_sharded import TieringFSDPStrategy, TieringModelParallelStrategy
    from core.errors import BadInput

    with pytest.raises(BadInput, match="use TieringCheckpointIO"):
        TieringFSDPStrategy(run="lit", state_dict_type="full")
    with pytest.raises(BadInput, match="use TieringCheckpointIO"):
        TieringModelParallelStrategy(run="lit", save_distributed_checkpoint=False)
    with pytest.raises(BadInput, match="without part/parts"):
        TieringModelParallelStrategy(run="lit", stager_options={"part": 1, "parts": 2})
    assert TieringFSDPStrategy(run="lit").saved == []  # sharded by default
