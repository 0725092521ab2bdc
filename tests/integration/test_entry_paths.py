"""Every documented way to hand a checkpoint over, taken as a new user takes it.

``ckpt up`` runs for real (one for the module). Each entry path runs in a shell of its own
whose environment is a fresh login's (``PATH``, ``HOME``, ``PYTHONPATH``) plus the ``export``
lines ``ckpt up`` printed, nothing else: the client, ``ckpt watch``, ``ckpt commit``, the
plain HTTP call of docs/training.md (run verbatim from there), the Hugging Face Trainer
callback, the Lightning plugin and the DCP async helper. Each job writes a small real
checkpoint (tiny models built from a config, no download) tagged a milestone the way its
README section says; the catalog, asked through the CLI in the same shell, must show it
verified on Tier 1 and Tier 2, and ``ckpt restore --tier 2`` must give back the bytes the job
wrote. Every event must have left before its sender exited (a job that saves and exits must not
leave its checkpoint to the next reconcile).

The jobs are separate runs and start together, so the module waits for its slowest path rather
than for the sum of them; each test collects its own. Each prints the time from the commit on
Tier 0 (the manifest's ``created_at``) to verified on Tier 1 and Tier 2 (run with ``-s``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from ckpt.processes import stop_process
from tests.kit.agents import wait_for
from tests.kit.up import REPO, fresh_shell_env, start_up_anywhere

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.timeout(600)]  # the first test also starts ckpt up

JOB_TIMEOUT = 180  # a job's own run (imports of torch, transformers, lightning included)
TIERS_TIMEOUT = 180  # from the job's end to verified on Tier 1 and Tier 2


@dataclass
class Shell:
    """A fresh shell with ``ckpt up``'s exports: runs commands in ``cwd`` with ``env`` only."""

    env: dict[str, str]
    cwd: Path
    logs: Path
    beside: list[subprocess.Popen] = field(default_factory=list)  # running beside the job (ckpt watch)

    def run(self, command: str, *, timeout: float = JOB_TIMEOUT) -> str:
        out = subprocess.run(["bash", "-ec", command], capture_output=True, text=True, env=self.env, cwd=self.cwd,
                             timeout=timeout)
        with open(self.cwd / "shell.log", "a") as log:  # what the user would have seen, for a failure's story
            log.write(f"$ {command.strip()}\n{out.stdout}{out.stderr}")
        assert out.returncode == 0, f"{command}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
        return out.stdout

    def python(self, source: str) -> str:
        """``python job.py`` in this shell; returns the last line it printed."""
        (self.cwd / "job.py").write_text(textwrap.dedent(source))
        return self.run("python job.py").strip().splitlines()[-1]

    def start(self, *argv: str) -> None:
        """``argv`` left running beside the job, its output in ``<argv[1]>.log``."""
        with open(self.cwd / f"{argv[1]}.log", "wb") as log:
            self.beside.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.cwd))

    def stop(self) -> list[int]:
        """Ctrl-C to what runs beside the job (time to send what it still holds); exit codes."""
        for p in self.beside:
            stop_process(p, grace=60)
        return [p.returncode for p in self.beside]

    def ckpt_json(self, *args: str):
        return json.loads(self.run(shlex.join(["ckpt", *args, "--json"]), timeout=60))

    def agent_log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.logs.glob("agent-*.log")))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("entry-paths")
    up, _port = start_up_anywhere(root / "stack", env=fresh_shell_env(root / "home"), cwd=root)
    try:
        yield root, up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def jobs(stack, request):
    """The job of every selected path, started at once, each in a shell of its own (they are
    separate runs): the module waits for its slowest path, not for the sum of them. A test
    takes its own."""
    root, up = stack
    env = {**fresh_shell_env(root / "home"), **up.exports}
    selected = {item.callspec.params["path"] for item in request.session.items if item.module is request.module}
    shells = {name: Shell(env, root / name, root / "stack" / "logs") for name in PATHS if name in selected}
    with ThreadPoolExecutor(len(PATHS)) as pool:
        try:
            yield {name: pool.submit(_job, PATHS[name], sh) for name, sh in shells.items()}
        finally:
            for sh in shells.values():
                sh.stop()


@dataclass(frozen=True)
class Job:
    shell: Shell
    run: str
    step: int
    written: Path  # the folder holding the bytes the job wrote


def _job(fn: Callable[[Shell], tuple[str, int, Path]], shell: Shell) -> Job:
    shell.cwd.mkdir()
    return Job(shell, *fn(shell))


# --- the paths: each writes one checkpoint as its README section says, returns (run, step, folder
# --- holding the bytes the job wrote) ------------------------------------------------------------
def client(sh: Shell) -> tuple[str, int, Path]:
    path = sh.python("""
        import numpy as np
        from ckpt.client import CheckpointStager

        rng = np.random.default_rng(0)
        tensors = {f"layer{i}.weight": rng.standard_normal((256, 256), dtype=np.float32) for i in range(4)}
        with CheckpointStager("e2e-client") as stager:
            saved = stager.save(10, tensors, metrics={"loss": 2.5}, milestone=True)
        print(saved.path)
    """)
    return "e2e-client", 10, Path(path)


def watch(sh: Shell) -> tuple[str, int, Path]:
    # ckpt watch beside a job that cannot import anything of ours: a shell loop writing raw files
    sh.start("ckpt", "watch", "ckpts", "--run", "e2e-watch", "--milestone-every", "10")
    sh.run("""
        mkdir -p ckpts/step-10
        head -c 1048576 /dev/urandom > ckpts/step-10/weights.bin
        head -c 524288 /dev/urandom > ckpts/step-10/optimizer.bin
        touch ckpts/step-10/COMMITTED
    """)
    wait_for("ckpt watch to commit step 10",
             lambda: "committed e2e-watch step 10" in (sh.cwd / "watch.log").read_text(), timeout=JOB_TIMEOUT)
    return "e2e-watch", 10, sh.cwd / "ckpts" / "step-10"


def commit(sh: Shell) -> tuple[str, int, Path]:
    # a job that writes a plain safetensors file with its own library, then one command
    sh.python("""
        import os

        import numpy as np
        from safetensors.numpy import save_file

        rng = np.random.default_rng(1)
        os.makedirs("out")
        save_file({"embed": rng.standard_normal((512, 256), dtype=np.float32)}, "out/model.safetensors")
        print("saved")
    """)
    sh.run("ckpt commit out --run e2e-commit --step 10 --milestone")
    return "e2e-commit", 10, sh.cwd / "out"


def http(sh: Shell) -> tuple[str, int, Path]:
    # the block of docs/training.md, verbatim, after the job wrote its folder
    sh.run("mkdir -p ckpt-1200 && head -c 1048576 /dev/urandom > ckpt-1200/weights.bin")
    sh.run(http_block())
    return "run-a", 1200, sh.cwd / "ckpt-1200"


def http_block() -> str:
    text = (REPO / "docs" / "training.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)
    (block,) = [b for b in blocks if "curl" in b and "/events" in b]
    return block


def hf(sh: Shell) -> tuple[str, int, Path]:
    path = sh.python("""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

        from ckpt.integrations.hf import TieringCallback

        class Tokens(torch.utils.data.Dataset):
            ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
            def __len__(self):
                return len(self.ids)
            def __getitem__(self, i):
                return {"input_ids": self.ids[i], "labels": self.ids[i]}

        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
        args = TrainingArguments(output_dir="out", max_steps=2, save_steps=2, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, disable_tqdm=True)
        cb = TieringCallback(run="e2e-hf", milestone=lambda step: True)
        Trainer(model, args, train_dataset=Tokens(), callbacks=[cb]).train()
        print(cb.saved[-1].result().path)
    """)
    return "e2e-hf", 2, Path(path)


def lightning(sh: Shell) -> tuple[str, int, Path]:
    path = sh.python("""
        import lightning as L
        import torch
        from lightning.pytorch.callbacks import ModelCheckpoint

        from ckpt.integrations.lightning import TieringCheckpointIO

        class Tiny(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(64, 64)
            def training_step(self, batch, _idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self.layer(x), y)
            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-2)

        data = torch.utils.data.TensorDataset(torch.randn(16, 64), torch.randn(16, 64))
        io = TieringCheckpointIO(run="e2e-lightning", milestone=lambda step: True)
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, plugins=[io],
                            callbacks=[ModelCheckpoint(dirpath="out", every_n_train_steps=2)])
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
        print(io.saved[-1].result().path)
    """)
    return "e2e-lightning", 2, Path(path)


def dcp(sh: Shell) -> tuple[str, int, Path]:
    path = sh.python("""
        import torch

        from ckpt.client import CheckpointStager
        from ckpt.integrations.dcp import async_save_and_commit

        model = torch.nn.Linear(256, 256)
        optim = torch.optim.AdamW(model.parameters())
        with CheckpointStager("e2e-dcp") as stager:
            fut = async_save_and_commit({"model": model.state_dict(), "optim": optim.state_dict()}, stager, 10,
                                        milestone=True)
            saved = fut.result(120)
        print(saved.path)
    """)
    return "e2e-dcp", 10, Path(path)


PATHS: dict[str, Callable[[Shell], tuple[str, int, Path]]] = {
    "client": client, "watch": watch, "commit": commit, "http": http, "hf": hf, "lightning": lightning, "dcp": dcp,
}


# --- what a user checks -------------------------------------------------------------------------
def verified_tiers(catalog_url: str, run: str, step: int) -> set[int]:
    """Tiers holding a verified copy, read straight from the catalog: cheap enough to poll on a
    busy machine (a CLI process per poll would take CPU from the agent); the CLI has the last word."""
    from db.catalog import Catalog

    cat = Catalog(catalog_url)
    try:
        return {r.tier for r in cat.replicas(cat.get_checkpoint(run, step).id) if r.state == "verified"}
    finally:
        cat.close()


def data_files(folder: Path) -> dict[str, bytes]:
    """The checkpoint's files under ``folder`` (manifests and marker files aside)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith("manifest") and p.name not in ("COMMITTED", "MILESTONE")}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_new_user_checkpoint_reaches_tier1_and_tier2(jobs, path):
    job = jobs[path].result(timeout=JOB_TIMEOUT)
    sh, run, step = job.shell, job.run, str(job.step)
    try:
        wait_for(f"{run}/{step} verified on Tier 1 and Tier 2",
                 lambda: {1, 2} <= verified_tiers(sh.env["CKPT_CATALOG_URL"], run, job.step),
                 timeout=TIERS_TIMEOUT, interval=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- agent log\n{sh.agent_log()}") from None
    finally:
        stopped = sh.stop()
    said = "".join(p.read_text() for p in sorted(sh.cwd.glob("*.log")))
    assert stopped == [0] * len(stopped), said[-3000:]
    # every event left before its sender exited (else only reconcile, a minute or more later, finds it)
    assert "reconcile will catch them" not in said, said[-3000:]

    shown = sh.ckpt_json("show", run, step)
    assert shown["checkpoint"]["kind"] == "milestone"
    assert {(r["tier"], r["state"]) for r in shown["replicas"]} >= {(1, "verified"), (2, "verified")}, shown

    report = sh.ckpt_json("restore", run, "--step", step, "--tier", "2", "--to", "restored")
    assert report["tiers"] and set(report["tiers"]) == {2}, report
    assert data_files(sh.cwd / "restored") == data_files(job.written) != {}

    written_at = datetime.fromisoformat(json.loads((sh.cwd / "restored" / "manifest.json").read_text())["created_at"])
    on = {t: max(datetime.fromisoformat(r["verified_at"]) for r in shown["replicas"] if r["tier"] == t) for t in (1, 2)}
    print(f"\n{path}: committed on Tier 0 -> verified on Tier 1 {(on[1] - written_at).total_seconds():.1f} s, "
          f"on Tier 2 {(on[2] - written_at).total_seconds():.1f} s")
