"""One node of the Lightning job (a rank per node) that is killed and resumed, run as
``python -m tests.kit.lightning_sharded_resume_job OUT ATTEMPT MAX_STEPS [KILL_AT]`` with the
node's environment (``tests.kit.lightning.run_nodes``). The module of
``tests.kit.lightning_sharded_job`` starts from the same weights on every launch, trains on data
drawn afresh by every process (a re-training never gives the same bytes) under
``TieringModelParallelStrategy`` of run ``lit-resume`` as attempt ATTEMPT, and resumes from
``strategy.resume_path()``; ``ModelCheckpoint`` saves every 2 steps, every launch into the one
folder ``OUT/checkpoints/last.ckpt``; the job has as many nodes as were started (``WORLD_SIZE``).
Global rank 0 writes the full model state it saves (``OUT/saved-<attempt>-<step>.pt``) and the one it resumed with
(``OUT/resumed-<attempt>.pt``, with the step). With KILL_AT, every rank kills itself (SIGKILL)
at the start of that step, once its node's commits are on Tier 0. A node given
``CKPT_TEST_CKPT_PATH`` passes that path to ``fit`` instead (a path of its own)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ckpt.integrations.lightning_sharded import TieringModelParallelStrategy
from core.settings import Settings
from tests.kit.lightning_sharded_job import Sharded

RUN = "lit-resume"


def full_state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The module's parameters, whole (a collective: every rank calls it)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}


class Record(Callback):
    def __init__(self, out: Path, attempt: str, kill_at: int | None) -> None:
        self.out, self.attempt, self.kill_at = out, attempt, kill_at

    def on_train_start(self, trainer, module):
        state = full_state(module)
        if trainer.global_rank == 0:
            torch.save({"step": trainer.global_step, "state": state}, self.out / f"resumed-{self.attempt}.pt")

    def on_save_checkpoint(self, trainer, module, checkpoint):
        state = full_state(module)
        if trainer.global_rank == 0:
            torch.save(state, self.out / f"saved-{self.attempt}-{trainer.global_step}.pt")

    def on_train_batch_start(self, trainer, *_args):
        if trainer.global_step == self.kill_at:
            trainer.strategy.wait()
            print("committed", [f.result().step for f in trainer.strategy.saved], flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, attempt: str, max_steps: int, kill_at: int | None) -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    settings = Settings.model_validate_json(os.environ["CKPT_TEST_SETTINGS"])
    nodes = int(os.environ["WORLD_SIZE"])
    strategy = TieringModelParallelStrategy(run=RUN, stager_options={"settings": settings, "attempt": attempt},
                                            data_parallel_size=nodes, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=nodes, strategy=strategy, max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=Path(out) / "checkpoints", every_n_train_steps=2,
                                                   save_top_k=0, save_last=True),
                                   Record(Path(out), attempt, kill_at)])
    ckpt_path = os.environ.get("CKPT_TEST_CKPT_PATH") or strategy.resume_path()
    print("resume", ckpt_path, flush=True)
    torch.manual_seed(0)  # the same initial weights on every rank and every launch
    trainer.fit(Sharded(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    print("committed", [f.result().step for f in strategy.saved], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
