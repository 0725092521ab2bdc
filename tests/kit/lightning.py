"""The tiny LightningModule the Lightning tests train (one linear layer, AdamW), seeded, so a
save and its resume start from the same weights (import ``tiny_module`` only where ``lightning``
is installed); ``run_nodes``, the launcher of the two-node jobs of ``tests.kit``."""

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


def run_nodes(module: str, args: list[str], nodes: list, *, timeout: float = 100,
              node_env: dict[int, dict[str, str]] | None = None) -> list[tuple[int, str]]:
    """``python -m module *args`` once per node of ``nodes`` (their settings), each the node rank of
    its index in a job of that many nodes of one rank (gloo on loopback), as torchrun starts them,
    with ``node_env[rank]`` on top; waits for all. Each node's (return code, output)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ckpt.processes import free_port

    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(len(nodes)),
             "NODE_RANK": str(rank), "LOCAL_RANK": "0", "PREFECT_API_URL": "",
             "CKPT_TEST_SETTINGS": node.model_dump_json(), **(node_env or {}).get(rank, {})},
        cwd=str(Path(__file__).resolve().parents[2]),  # the repository: ``-m tests.kit...`` is found from here
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank, node in enumerate(nodes)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # one that hangs (its peer died in a collective) is not left behind
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]
