"""The tiny LightningModule the Lightning tests train (one linear layer, AdamW), seeded, so a
save and its resume start from the same weights. Import only where ``lightning`` is installed."""

from __future__ import annotations

import torch


def tiny_module():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    return Tiny()
