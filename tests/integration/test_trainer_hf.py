"""The Hugging Face Trainer integration with the real ``transformers`` Trainer: a tiny GPT-2 built
from a config (no download) trains a few steps on CPU; ``TieringCallback`` commits each
``checkpoint-N`` on Tier 0; the real promotion and restore (plain functions, SQLite catalog, no
Prefect server) bring step N back; ``resume_from_checkpoint`` continues from it and the
resumed run's lineage points at it."""

from __future__ import annotations

import pytest

from tests.kit.require import require_module

require_module("transformers")
require_module("accelerate")

import torch  # noqa: E402

from tests.kit.restore import promote, scenario_settings, tier0_dir  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 8, vocab: int = 64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(out, callbacks, max_steps: int):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)


def test_trainer_checkpoints_commit_restore_and_resume(settings_factory, sqlite_url, tmp_path, monkeypatch):
    from transformers import TrainerCallback

    from ckpt.integrations.hf import TieringCallback
    from core.manifest import Manifest
    from db.catalog import Catalog
    from tasks.restore import restore_checkpoint

    monkeypatch.setenv("PREFECT_API_URL", "")  # no Prefect server: the announcer registers the run, sends nothing
    settings = scenario_settings(settings_factory, sqlite_url)

    cb = TieringCallback(run="hf-run", settings=settings)
    trainer = _trainer(tmp_path / "out", [cb], max_steps=4)
    trainer.train()
    assert [f.result().step for f in cb.saved] == [2, 4]
    assert not list((tmp_path / "out").glob("checkpoint-*")), "the Trainer's folders were moved to Tier 0"
    ck4 = tier0_dir(settings, "hf-run", 4)
    manifest = Manifest.from_json((ck4 / "manifest.json").read_bytes())
    names = {f.path for f in manifest.files}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= names, names
    assert manifest.format == "safetensors" and manifest.metrics.get("loss", 0) > 0
    assert manifest.writer_stall_seconds is not None and manifest.writer_stall_seconds == pytest.approx(
        cb.stalls[4], abs=1e-5)

    promote(settings, "hf-run", 4)
    restored = tmp_path / "restored"
    restore_checkpoint(settings, "hf-run", restored, step=4)

    seen: list[int] = []

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(state.global_step)

    # announce=False: the resumed job never reaches the catalog; its manifests carry the origin
    cb2 = TieringCallback(run="hf-run-2", settings=settings, resumed_from=restored, announce=False)
    assert cb2.origin == ("hf-run", 4)
    trainer2 = _trainer(tmp_path / "out2", [cb2, FirstStep()], max_steps=6)
    trainer2.train(resume_from_checkpoint=str(restored))
    assert seen == [5, 6], "resumed at step 4, trained steps 5 and 6 only"
    assert [f.result().step for f in cb2.saved] == [6]

    promote(settings, "hf-run-2", 6)
    with Catalog(settings.catalog_url) as cat:
        run2 = cat.get_run("hf-run-2")
        assert (run2.parent_run, run2.parent_step, run2.parent_relation) == ("hf-run", 4, "resumed_from")
        edges = cat.ancestors("hf-run-2", 6)
    assert [(e.parent_run, e.parent_step, e.relation) for e in edges] == [("hf-run", 4, "resumed_from")]


def test_a_part_of_many_is_refused_before_training(settings_factory, sqlite_url, tmp_path, monkeypatch):
    """The world's process zero commits the Trainer's whole folder: a callback created as part 1
    of 2 would leave the checkpoint waiting for a part no process commits. It is refused at once."""
    from ckpt.integrations.hf import TieringCallback
    from core.errors import BadInput

    monkeypatch.setenv("PREFECT_API_URL", "")
    settings = scenario_settings(settings_factory, sqlite_url)
    with pytest.raises(BadInput, match=r"single-part checkpoints .* part=1, parts=2"):
        _trainer(tmp_path / "out", [TieringCallback(run="gpt-ranks", settings=settings, part=1, parts=2)],
                 max_steps=2).train()
    assert not (tmp_path / "out").exists() and not tier0_dir(settings, "gpt-ranks", 2).exists()
