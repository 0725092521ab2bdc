"""The trainer integrations on a Tier 0 too small for the checkpoint (a real tmpfs): each check
comes before its library writes, and ``StorageFull`` reaches the job the way that library
reports a failed save (HF: out of ``trainer.train()``; Lightning: out of ``save_checkpoint``;
DCP: on the returned future), with nothing written on Tier 0."""

from __future__ import annotations

import pytest

from tests.kit.require import require_module

torch = require_module("torch")

from core.errors import StorageFull  # noqa: E402
from tests.kit.restore import scenario_settings  # noqa: E402
from tests.kit.tmpfs import mounted_tmpfs  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture
def small_tier0(settings_factory, sqlite_url, tmp_path, monkeypatch):
    """Settings whose Tier 0 is a 128 KiB tmpfs; no wait for retention (nothing to retire)."""
    monkeypatch.setenv("PREFECT_API_URL", "")
    with mounted_tmpfs(tmp_path / "nvme", "128k") as root:
        yield scenario_settings(settings_factory, sqlite_url, runs=("job",), tier0_url=str(root),
                                tier0_space_wait_seconds=0), root


def written(root) -> list[str]:
    """The files under the Tier 0 root but its identity marker (``core.storage.identity``)."""
    from core.storage.identity import MARKER_KEY

    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MARKER_KEY)


def test_hf_trainer_raises_storage_full_before_it_saves(small_tier0):
    require_module("transformers")
    require_module("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ckpt.integrations.hf import TieringCallback
    from tests.integration.test_trainer_hf import _Tokens

    settings, root = small_tier0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(root / "out"), max_steps=4, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    cb = TieringCallback(run="job", settings=settings, announce=False)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb])
    with pytest.raises(StorageFull, match="job step 2 needs"):
        trainer.train()
    cb.close()
    assert trainer.state.global_step == 2  # stopped at the first save, before the Trainer wrote it
    assert written(root) == []


def test_lightning_save_raises_storage_full_before_it_writes(small_tier0):
    require_module("lightning")
    from ckpt.integrations.lightning import TieringCheckpointIO

    settings, root = small_tier0
    io = TieringCheckpointIO(run="job", settings=settings, announce=False)
    target = root / "lightning" / "epoch=0-step=3.ckpt"
    with pytest.raises(StorageFull, match="job step 3 needs"):
        io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.zeros(64 * 1024)}}, target)
    io.teardown()
    assert written(root) == [] and not io.saved


def test_dcp_future_carries_storage_full_and_dcp_never_starts(small_tier0):
    from ckpt.client import CheckpointStager
    from ckpt.integrations.dcp import async_save_and_commit

    settings, root = small_tier0
    with CheckpointStager("job", settings=settings, announce=False) as stager:
        fut = async_save_and_commit({"w": torch.zeros(64 * 1024)}, stager, 5)
        with pytest.raises(StorageFull, match="job step 5 needs"):
            fut.result(30)
    assert written(root) == []
