"""One node of a two-node Lightning job on CPU (gloo), as ``torchrun`` would start it: run as
``python -m tests.kit.lightning_sharded_job OUT`` with ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE=2``, ``NODE_RANK``, ``LOCAL_RANK=0`` and ``CKPT_TEST_SETTINGS`` (the node's settings
as JSON). A tiny module sharded with ``fully_shard`` trains four steps under
``TieringModelParallelStrategy``; ``ModelCheckpoint`` saves steps 2 and 4 as distributed
checkpoints, both into the one folder ``last.ckpt``, which the second save writes again."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckpt.integrations.lightning_sharded import TieringModelParallelStrategy
from core.settings import Settings


class Sharded(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
    settings = Settings.model_validate_json(os.environ["CKPT_TEST_SETTINGS"])
    strategy = TieringModelParallelStrategy(run="lit-sharded", stager_options={"settings": settings},
                                            data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=4, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=0, save_last=True)])
    trainer.fit(Sharded(), torch.utils.data.DataLoader(data, batch_size=4))
    print("committed", [f.result().step for f in strategy.saved], flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
