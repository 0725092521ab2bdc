"""Resume with one line in each trainer, after the training process was killed: a tiny model
trains in a subprocess that commits steps 2 and 4 and is killed (SIGKILL) during step 5; the
agent's promotion runs (plain functions, SQLite catalog); the one line (``resume_from``,
``resume_path``, ``resume_point(...).path``) resumes it, and training continues from step 4
with the optimizer state that step saved. Resuming the same run records no lineage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.require import require_module

torch = require_module("torch")

from tests.kit.restore import promote, scenario_settings, tier0_dir  # noqa: E402

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:You're resuming from a checkpoint",
                                "ignore:.*LeafSpec.*is deprecated", "ignore:torch.distributed is disabled"),
]
ROOT = Path(__file__).resolve().parents[2]


def optimizer_digest(state: dict) -> list:
    """What an AdamW state holds per parameter (step, moments), as plain numbers."""
    out = []
    for key, s in sorted(state["state"].items()):
        out.append([int(key), float(s["step"]), float(s["exp_avg"].double().sum()),
                    float(s["exp_avg_sq"].double().sum())])
    return out


def run_killed(script: str, settings, *args: str) -> None:
    """Run ``script`` as a training process that kills itself; it must die by SIGKILL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": "", "CKPT_DATA_DIR": str(settings.data_dir),
           "CKPT_NODE": settings.node, "CKPT_CATALOG_URL": settings.catalog_url}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=str(ROOT), timeout=150,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def no_lineage(settings, run: str, step: int) -> None:
    from db.catalog import Catalog

    with Catalog(settings.catalog_url) as cat:
        assert cat.get_run(run).parent_run is None
        assert {e.relation for e in cat.ancestors(run, step)} == {"follows"}  # its own earlier steps only


# --- Hugging Face ------------------------------------------------------------------------------
def hf_trainer(out, callbacks, max_steps: int):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


HF_TRAIN = """
import json, os, signal, sys
from transformers import TrainerCallback
from ckpt.integrations.hf import TieringCallback, resume_from
from tests.integration.test_trainer_resume import hf_trainer, optimizer_digest
out = sys.argv[1]
cb = TieringCallback(run="hf-r")

class Die(TrainerCallback):
    def on_save(self, args, state, control, optimizer=None, **kw):
        if state.global_step == 4:
            json.dump(optimizer_digest(optimizer.state_dict()), open(os.path.join(out, "opt-4.json"), "w"))

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 5:
            cb.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)

trainer = hf_trainer(os.path.join(out, "trainer"), [cb, Die()], max_steps=8)
trainer.train(resume_from_checkpoint=resume_from("hf-r"))  # no checkpoint yet: a fresh start
"""


def test_hf_trainer_resumes_with_one_line_after_a_kill(settings_factory, db_url, tmp_path, monkeypatch):
    require_module("transformers")
    require_module("accelerate")
    from transformers import TrainerCallback

    from ckpt.integrations.hf import TieringCallback, resume_from

    monkeypatch.setenv("PREFECT_API_URL", "")
    settings = scenario_settings(settings_factory, db_url)
    run_killed(HF_TRAIN, settings, str(tmp_path))
    for step in (2, 4):
        promote(settings, "hf-r", step)

    seen: list = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            if not seen:
                seen.append((state.global_step, optimizer_digest(optimizer.state_dict())))

    path = resume_from("hf-r", settings=settings)
    assert path == str(tier0_dir(settings, "hf-r", 4))
    cb = TieringCallback(run="hf-r", settings=settings)
    hf_trainer(tmp_path / "again", [cb, Probe()], max_steps=6).train(resume_from_checkpoint=path)

    assert seen[0][0] == 4
    assert seen[0][1] == json.loads((tmp_path / "opt-4.json").read_text())
    assert [f.result().step for f in cb.saved] == [6]
    promote(settings, "hf-r", 6)
    no_lineage(settings, "hf-r", 6)
    assert TieringCallback(run="hf-r2", resumed_from=resume_from("hf-r", settings=settings)).origin == ("hf-r", 6)


# --- Lightning ---------------------------------------------------------------------------------
def lit_trainer(out, io, max_steps: int, callbacks=()):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    mc = ModelCheckpoint(dirpath=str(out), every_n_train_steps=2, save_top_k=-1)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(out), callbacks=[mc, *callbacks],
                     plugins=[io])


def lit_module_and_data():
    from tests.kit.lightning import tiny_module

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return tiny_module(), torch.utils.data.DataLoader(data, batch_size=4)


LIT_TRAIN = """
import json, os, signal, sys
from lightning.pytorch.callbacks import Callback
from ckpt.integrations.lightning import TieringCheckpointIO, resume_path
from tests.integration.test_trainer_resume import lit_module_and_data, lit_trainer, optimizer_digest
out = sys.argv[1]
io = TieringCheckpointIO(run="lit-r")

class Die(Callback):
    def on_save_checkpoint(self, trainer, module, checkpoint):
        if checkpoint["global_step"] == 4:
            json.dump(optimizer_digest(checkpoint["optimizer_states"][0]), open(os.path.join(out, "opt-4.json"), "w"))

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 5:
            io.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)

model, data = lit_module_and_data()
lit_trainer(os.path.join(out, "trainer"), io, 8, [Die()]).fit(model, data, ckpt_path=resume_path("lit-r"))
"""


def test_lightning_resumes_with_one_line_after_a_kill(settings_factory, db_url, tmp_path, monkeypatch):
    require_module("lightning")
    from lightning.pytorch.callbacks import Callback

    from ckpt.integrations.lightning import TieringCheckpointIO, resume_path

    monkeypatch.setenv("PREFECT_API_URL", "")
    settings = scenario_settings(settings_factory, db_url)
    run_killed(LIT_TRAIN, settings, str(tmp_path))
    for step in (2, 4):
        promote(settings, "lit-r", step)

    seen: list = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, *args):
            if not seen:
                seen.append((trainer.global_step, optimizer_digest(trainer.optimizers[0].state_dict())))

    path = resume_path("lit-r", settings=settings)
    assert Path(path).parent == tier0_dir(settings, "lit-r", 4)
    io = TieringCheckpointIO(run="lit-r", settings=settings)
    model, data = lit_module_and_data()
    lit_trainer(tmp_path / "again", io, 6, [Probe()]).fit(model, data, ckpt_path=path)

    assert seen[0][0] == 4
    assert seen[0][1] == json.loads((tmp_path / "opt-4.json").read_text())
    assert [f.result().step for f in io.saved] == [6]
    promote(settings, "lit-r", 6)
    no_lineage(settings, "lit-r", 6)


# --- DCP ---------------------------------------------------------------------------------------
def dcp_setup():
    """A tiny model and its AdamW, the same at every call."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def dcp_step(model, optim, step: int) -> None:
    """Training step ``step`` (1-based) on its own batch of a fixed data set."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    i = (step - 1) * 4 % 64
    loss = torch.nn.functional.mse_loss(model(x[i:i + 4]), y[i:i + 4])
    optim.zero_grad()
    loss.backward()
    optim.step()


def dcp_state(model, optim, step: int) -> dict:
    """What a DCP job saves and loads in place: model, optimizer (state allocated), global step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


def same(a, b) -> bool:
    """Equal state dicts: every tensor bit for bit, everything else by value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


DCP_TRAIN = """
import os, signal, sys
import torch
from ckpt.client import CheckpointStager
from ckpt.integrations.dcp import async_save_and_commit
from ckpt.resume import resume_point
from tests.integration.test_trainer_resume import dcp_setup, dcp_state, dcp_step
out = sys.argv[1]
model, optim = dcp_setup()
assert resume_point("dcp-k", part=0, parts=1) is None  # no checkpoint yet: a fresh start
stager, saves = CheckpointStager("dcp-k", announce=False), []
for step in range(1, 9):
    dcp_step(model, optim, step)
    if step % 2 == 0:
        saves.append(async_save_and_commit(dcp_state(model, optim, step), stager, step))
    if step == 4:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, os.path.join(out, "at-4.pt"))
    if step == 5:
        for fut in saves:
            fut.result(60)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_dcp_resumes_with_one_line_after_a_kill(settings_factory, db_url, tmp_path):
    """The node also comes back with its NVMe wiped: the one line fetches step 4 from Tier 1 (an
    object store here) into Tier 0, and ``dcp.load`` reads it there."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ckpt.client import CheckpointStager
    from ckpt.integrations.dcp import async_save_and_commit
    from ckpt.resume import resume_point

    settings = scenario_settings(settings_factory, db_url, runs=("dcp-k",),
                                 tier1_url=f"memory://dcp-k-{os.getpid()}-{id(tmp_path)}")
    run_killed(DCP_TRAIN, settings, str(tmp_path))
    for step in (2, 4):
        promote(settings, "dcp-k", step)
    shutil.rmtree(tier0_dir(settings, "dcp-k", 4).parent)

    model, optim = dcp_setup()
    state = dcp_state(model, optim, 0)
    dcp.load(state, checkpoint_id=resume_point("dcp-k", part=0, parts=1, settings=settings).path, no_dist=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    at4 = torch.load(tmp_path / "at-4.pt")
    assert int(state["step"]) == 4
    again = resume_point("dcp-k", settings=settings)  # the wiped Tier 0 has step 4 again: fetched there
    assert again.path == str(tier0_dir(settings, "dcp-k", 4)) and again.parts[0].source == "in place"
    assert same(model.state_dict(), at4["model"]) and same(optim.state_dict(), at4["optim"])
    for step in (5, 6):  # training goes on from step 4 exactly as if it had never stopped
        dcp_step(model, optim, step)
    ref_model, ref_optim = dcp_setup()
    for step in range(1, 7):
        dcp_step(ref_model, ref_optim, step)
    assert same(model.state_dict(), ref_model.state_dict()) and same(optim.state_dict(), ref_optim.state_dict())
    with CheckpointStager("dcp-k", settings=settings, announce=False) as stager:
        assert async_save_and_commit(dcp_state(model, optim, 6), stager, 6).result(30).step == 6
    promote(settings, "dcp-k", 6)
    no_lineage(settings, "dcp-k", 6)
    assert resume_point("dcp-k", part=0, parts=1, settings=settings).path == str(tier0_dir(settings, "dcp-k", 6))
