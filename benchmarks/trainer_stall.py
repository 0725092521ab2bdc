"""Training-loop stall of the trainer integrations against each library's own save, same run.

Full size by hand; CI runs only its ``--smoke`` form. Real libraries, tiny models built from a
config in code (no download), trained on CPU, checkpoints of about ``--mb`` MB (weights plus
the optimizer's two AdamW moments, so about a third of it is weights):

- Hugging Face ``transformers`` Trainer, a GPT-2 (``GPT2Config``, ``n_embd`` 256, vocabulary
  1024, ``n_layer`` sized to ``--mb``), saving every ``--save-every`` steps:
  baseline: the Trainer's own save (``checkpoint-N``: safetensors, optimizer, scheduler, RNG,
  trainer state), no callback; ours: the same with ``TieringCallback`` (moves the folder onto
  Tier 0 with one rename; CRC32C, manifest and commit on its own thread).
  The stall is the wall time from the end of the save step's ``on_step_end`` (the Trainer saves
  right after it) to the end of ``on_save``, timed by a callback placed after every other one:
  it covers ``Trainer._save_checkpoint`` and every ``on_save``, ours included.
- PyTorch Lightning, a stack of ``Linear(512, 512)`` layers sized to ``--mb``, ``ModelCheckpoint``
  every ``--save-every`` steps (``save_top_k=-1``): baseline: Lightning's default
  ``TorchCheckpointIO``; ours: ``TieringCheckpointIO`` (Lightning's write, then one hard link
  into Tier 0; the commit on its own thread). The stall is the wall time of
  ``ModelCheckpoint.on_train_batch_end`` on the save step (gathering the state, the write, ours),
  timed by a ``ModelCheckpoint`` subclass.

Each round trains each contender afresh (order rotated) for two saves and keeps the second:
the first pays the one-time costs (imports, the stager's thread, first allocations). Before
each timed save, untimed: our commit of the first save is waited for and ``sync`` flushes the
page cache, as for a job whose saves are minutes apart (the background commit's own cost is
measured by ``client_stall.py`` and ``promote_tier1.py``, not here). Events are off
(``announce=False``): they never run on the training thread anyway. DCP jobs are in
``client_stall.py``.

    python benchmarks/trainer_stall.py --mb 80 --rounds 5
    python benchmarks/trainer_stall.py --smoke    # about 12 MB, one round
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Times, bench_parser, parse, ratio, table
from core.settings import load_settings

SMOKE = {"mb": 8, "save_every": 2}
HF_WIDTH, HF_VOCAB, HF_SEQ = 256, 1024, 16
LIT_WIDTH = 512


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def settle(wait: Callable[[], None] | None) -> None:
    """Between two saves, untimed: the last commit done, dirty pages written back."""
    if wait is not None:
        wait()
    os.sync()


# --- Hugging Face Trainer -----------------------------------------------------------------------
def hf_round(root: Path, settings, mb: int, save_every: int, ours: bool, tag: str) -> tuple[float, int]:
    """Train a fresh GPT-2 for two saves; (stall of the second save, bytes of one checkpoint)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from ckpt.integrations.hf import TieringCallback  # deferred: start-up (imports transformers and torch)

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    per_layer_mb = 12 * HF_WIDTH * HF_WIDTH * 4 * 3 / 1e6  # weights + two AdamW moments
    layers = max(1, round((mb - (HF_VOCAB + HF_SEQ) * HF_WIDTH * 12 / 1e6) / per_layer_mb))

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, HF_VOCAB, (64, HF_SEQ), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    tiering = TieringCallback(run=f"hf-{tag}", settings=settings, announce=False) if ours else None

    class SaveTimer(TrainerCallback):
        """Placed last: its on_step_end ends the step, its on_save ends the save."""

        def __init__(self):
            self.t0 = 0.0
            self.stalls: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if (state.global_step + 1) % save_every == 0:
                settle(tiering.wait if tiering else None)

        def on_step_end(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_save(self, args, state, control, **kwargs):
            self.stalls.append(time.perf_counter() - self.t0)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=4, n_embd=HF_WIDTH, vocab_size=HF_VOCAB,
                                       n_positions=HF_SEQ, bos_token_id=0, eos_token_id=0))
    out = root / f"hf-out-{tag}"
    args = TrainingArguments(output_dir=str(out), max_steps=2 * save_every, save_strategy="steps",
                             save_steps=save_every, logging_strategy="no", per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    timer = SaveTimer()
    callbacks = [tiering, timer] if tiering else [timer]
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks).train()
    assert len(timer.stalls) == 2, timer.stalls
    if tiering:
        assert [f.result().step for f in tiering.saved] == [save_every, 2 * save_every]
        return timer.stalls[1], 0  # the folder moved to Tier 0: the baseline's gives the size
    return timer.stalls[1], folder_bytes(out / f"checkpoint-{2 * save_every}")


# --- Lightning ----------------------------------------------------------------------------------
def lightning_round(root: Path, settings, mb: int, save_every: int, ours: bool, tag: str) -> tuple[float, int]:
    """Train a fresh Linear stack for two saves; (stall of the second save, bytes of one checkpoint)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckpt.integrations.lightning import TieringCheckpointIO  # deferred: start-up (imports lightning and torch)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # its GPU/TPU lines and tips

    layers = max(1, round(mb / (LIT_WIDTH * LIT_WIDTH * 4 * 3 / 1e6)))

    class Stack(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(LIT_WIDTH, LIT_WIDTH) for _ in range(layers)])

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    io = TieringCheckpointIO(run=f"lit-{tag}", settings=settings, announce=False) if ours else None

    class TimedCheckpoint(ModelCheckpoint):
        """Lightning's ModelCheckpoint; the wall time of its save hook on the save steps."""

        stalls: list[float]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if (trainer.global_step + 1) % save_every == 0:
                settle(io.wait if io else None)

        def on_train_batch_end(self, trainer, *rest):
            t0 = time.perf_counter()
            super().on_train_batch_end(trainer, *rest)
            if trainer.global_step % save_every == 0:
                self.stalls.append(time.perf_counter() - t0)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, LIT_WIDTH, generator=g),
                                          torch.randn(64, LIT_WIDTH, generator=g))
    out = root / f"lit-out-{tag}"
    mc = TimedCheckpoint(dirpath=str(out), every_n_train_steps=save_every, save_top_k=-1)
    mc.stalls = []
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2 * save_every, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
                        callbacks=[mc], plugins=[io] if io else None)
    trainer.fit(Stack(), torch.utils.data.DataLoader(data, batch_size=4))
    assert len(mc.stalls) == 2, mc.stalls
    if io:
        assert [f.result().step for f in io.saved] == [save_every, 2 * save_every]
    return mc.stalls[1], max(p.stat().st_size for p in out.glob("*.ckpt"))


# --- the run ------------------------------------------------------------------------------------
def library_table(library: str, base: str, mine: str, round_fn, root: Path, args) -> None:
    res: Times = {base: [], mine: []}
    nbytes = 0
    for r in range(args.rounds):
        for name in ([base, mine] if r % 2 == 0 else [mine, base]):
            tag = f"{r}-{'ours' if name == mine else 'base'}"
            settings = load_settings(data_dir=root / "data", node="bench", catalog_url=f"sqlite:///{root}/c.db")
            stall, size = round_fn(root, settings, args.mb, args.save_every, name == mine, tag)
            res[name].append(stall)
            nbytes = nbytes or size
            for p in root.glob("*-out-*"):
                shutil.rmtree(p)
            shutil.rmtree(root / "data" / "tier0", ignore_errors=True)
    table(f"{library} save stall, checkpoint {nbytes / 1e6:.0f} MB, saving every {args.save_every} steps, "
          f"{args.rounds} rounds", res, base, nbytes=nbytes)
    print(f"ratio ({library}): ours / {base} = {ratio(res, mine, base):.2f} x")


def main() -> None:
    ap = bench_parser(__doc__, rounds=5)
    ap.add_argument("--mb", type=int, default=80, help="checkpoint size (weights + optimizer state), MB")
    ap.add_argument("--save-every", type=int, default=5, help="training steps between saves")
    ap.add_argument("--dir", type=Path, default=None, help="Tier 0 and the trainers' folders (default: a temp dir)")
    ap.add_argument("--only", choices=["hf", "lightning"], default=None, help="one library only")
    args = parse(ap, SMOKE)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and on CPU training
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-trainer-stall-"))
    try:
        if args.only in (None, "hf"):
            library_table("HF Trainer", "Trainer save (no callback)", "ours: Trainer save + TieringCallback",
                          hf_round, root, args)
        if args.only in (None, "lightning"):
            library_table("Lightning", "ModelCheckpoint, TorchCheckpointIO",
                          "ours: TieringCheckpointIO", lightning_round, root, args)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
