"""``make demo``: the whole system on embedded defaults, on this machine, in a few minutes.

Starts a Prefect server (SQLite) and moto's S3 server on loopback, serves the agents of two
simulated nodes, and runs a simulated training job: two ranks (one per node) write about a
dozen checkpoints of real safetensors shards every few seconds, a milestone every 4th; then a
second run resumes from a milestone, so the lineage has depth. It waits until every
checkpoint has reached its tiers (Tier 1 for all, Tier 2 for milestones), prints a summary
(tiers verified, time to durable, writer stall) and the lineage tree, and exits 0 only if
everything got where it should. Data and logs live under ``./.demo/`` (wiped at the start).

Sized for a 2-core machine: each agent runs at most ``--limit`` (2) flow runs at once (every
flow run is a Python process; more at once on 2 cores slow each other down and make the time
to durable longer, not shorter), and the agents skip the durable-triggered archive run (the
promote flow that completes a milestone archives it inline).

    python -m ckpt.demo [--keep-running] [--checkpoints 12] [--mb 64] [--interval 2.5]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console

from ckpt.client import CheckpointStager, SavedCheckpoint
from ckpt.commands.catalog import lineage_tree
from ckpt.local_stack import LocalStack
from ckpt.tables import FitTable, table as fit_table
from core.errors import NotFound
from core.settings import load_settings
from core.sizing import fmt_bytes
from core.space import folder_bytes
from core.tiers import ALL_TIERS
from db.catalog import Catalog

if TYPE_CHECKING:
    from rich.tree import Tree

NODES = ("node-0", "node-1")
RUN1, RUN2 = "pretrain", "resume"
console = Console()
if not console.is_terminal:
    console.width = 120  # the summary table, readable in a log


@dataclass
class Saved:
    """What the job knows about one checkpoint: when its last part was committed locally."""

    run: str
    step: int
    milestone: bool
    committed_at: float = 0.0
    stall: float = 0.0  # the slowest rank's stall
    bytes: int = 0


@dataclass
class Status:
    reached: bool
    tiers: dict[int, str] = field(default_factory=dict)  # tier -> 'verified' | 'pruned' | state | '-'
    durable_at: float | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--keep-running", action="store_true", help="keep the stack and the UI up until Ctrl-C")
    p.add_argument("--checkpoints", type=int, default=12, help="checkpoints of the first run")
    p.add_argument("--resumed", type=int, default=4, help="checkpoints of the resumed run")
    p.add_argument("--mb", type=int, default=64, help="size of one checkpoint (both ranks), MB")
    p.add_argument("--interval", type=float, default=4.0, help="seconds of 'training' between checkpoints")
    p.add_argument("--milestone-every", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the tiers")
    p.add_argument("--dir", type=Path, default=Path(".demo"))
    p.add_argument("--port", type=int, default=4200, help="Prefect server port (a free one if taken)")
    p.add_argument("--limit", type=int, default=2, help="flow runs at once per agent (2 cores: more only thrash)")
    return p.parse_args(argv)


# --- the simulated training job -------------------------------------------------------------
def rank_tensors(rank: int, nbytes: int) -> dict[str, np.ndarray]:
    """One rank's shard of the model: float32 layers, about ``nbytes`` in all."""
    rng = np.random.default_rng(rank)
    per_layer = 4_000_000
    n = max(1, nbytes // per_layer)
    return {f"layers.{rank * 100 + i}.weight": rng.standard_normal(per_layer // 4, dtype=np.float32)
            for i in range(n)}


def train(run: str, steps: list[int], args: argparse.Namespace, *,
          resumed_from: tuple[str, int] | None = None) -> list[Saved]:
    """Two ranks, one per node, each committing its part of every checkpoint on its Tier 0."""
    ranks = [rank_tensors(r, args.mb * 1_000_000 // len(NODES)) for r in range(len(NODES))]
    stagers = [CheckpointStager(run, node=node, part=r, parts=len(NODES), resumed_from=resumed_from,
                                shard_bytes=16 * 1024 * 1024) for r, node in enumerate(NODES)]
    saved: list[Saved] = []
    loss = 4.0 if resumed_from is None else 2.2
    with ThreadPoolExecutor(len(NODES)) as pool:
        for i, step in enumerate(steps):
            time.sleep(args.interval)  # "training"
            for t in ranks:
                for w in t.values():
                    w *= 0.999  # the weights move, so every checkpoint's bytes differ
            loss *= 0.93
            milestone = (i + 1) % args.milestone_every == 0

            def commit(r: int) -> SavedCheckpoint:
                part = stagers[r].save(step, ranks[r], metrics={"loss": round(loss, 4)}, milestone=milestone)
                assert isinstance(part, SavedCheckpoint)  # not a background stager: committed on return
                return part

            parts = list(pool.map(commit, range(len(NODES))))
            rec = Saved(run, step, milestone, time.time(), max(p.stall_seconds for p in parts),
                        sum(p.manifest.total_bytes for p in parts))
            saved.append(rec)
            console.print(f"  {run} step {step:>5}: {rec.bytes / 1e6:.0f} MB committed on Tier 0 by "
                          f"{len(NODES)} ranks, stall {rec.stall * 1000:.0f} ms"
                          + ("  [milestone]" if milestone else ""))
    for st in stagers:
        st.close()
    return saved


# --- watching the tiers -------------------------------------------------------------------------
def status(cat: Catalog, rec: Saved, tier2: bool) -> Status:
    """Whether ``rec`` reached Tier 1 (and Tier 2 if a milestone): every part's replica was
    verified there at some point (retention may have pruned it since, e.g. from Tier 0)."""
    try:
        ck = cat.get_checkpoint(rec.run, rec.step)
    except NotFound:
        return Status(False, {0: "-", 1: "-", 2: "-"})
    want = {1} | ({2} if rec.milestone and tier2 else set())
    st = Status(True)
    for tier in ALL_TIERS:
        reps = cat.replicas(ck.id, tier)
        ok = len({r.part for r in reps if r.verified_at is not None}) == ck.parts
        st.tiers[tier] = tier_label([r.state for r in reps])
        if tier in want and not ok:
            st.reached = False
    done = [h.at for h in cat.history(rec.run, rec.step) if h.action == "complete" and h.to_state == "tier1"]
    st.durable_at = done[0].timestamp() if done else None
    return st


def tier_label(states: list[str]) -> str:
    """'verified', 'pruned', '-' (no copy), or the mix per part: '1 pruned, 1 verified'."""
    if not states:
        return "-"
    if len(set(states)) == 1:
        return states[0]
    return ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))


def wait_for_tiers(saved: list[Saved], *, tier2: bool, timeout: float,
                   quiet: bool = False) -> dict[tuple[str, int], Status]:
    cat = Catalog(load_settings().catalog_url)
    deadline = time.monotonic() + timeout
    last = ""
    try:
        while True:
            got = {(r.run, r.step): status(cat, r, tier2) for r in saved}
            n = sum(s.reached for s in got.values())
            line = f"  {n}/{len(saved)} checkpoints on all their tiers"
            if line != last and not quiet:
                console.print(line)
                last = line
            if n == len(saved) or time.monotonic() > deadline:
                return got
            time.sleep(1.0)
    finally:
        cat.close()


# --- the report ----------------------------------------------------------------------------------
def summary_table(saved: list[Saved], got: dict[tuple[str, int], Status]) -> FitTable:
    mark = {"verified": "[green]✓[/green]", "-": "[dim]-[/dim]"}  # else the state(s), e.g. pruned
    cols = ("run", "step", "kind", "MB", "tier 0", "tier 1", "tier 2", "durable in", "stall", "ok")
    t = fit_table(*cols, title="Checkpoints (✓ verified; pruned: removed by retention while a verified copy is "
                  "kept elsewhere; per part when the parts differ)",
                  right=tuple(c for c in cols if c not in ("run", "kind")))
    for r in saved:
        s = got[(r.run, r.step)]
        ttd = f"{s.durable_at - r.committed_at:.1f} s" if s.durable_at else "-"
        t.add_row(r.run, str(r.step), "milestone" if r.milestone else "step", f"{r.bytes / 1e6:.0f}",
                  *(mark.get(s.tiers[k], s.tiers[k]) for k in (0, 1, 2)), ttd, f"{r.stall * 1000:.0f} ms",
                  "[green]yes[/green]" if s.reached else "[red]NO[/red]")
    return t


def lineage(saved: list[Saved]) -> Tree:
    root = saved[0]
    cat = Catalog(load_settings().catalog_url)
    try:
        edges = cat.descendants(root.run, root.step)
    finally:
        cat.close()
    return lineage_tree(root.run, root.step, edges, descendants=True)


def closing_lines(data_dir: Path, disk_bytes: int, *, kept_running: bool) -> list[str]:
    """The demo's last words: how to keep the UI up (after a run that did not), and the disk it
    leaves behind and where, with what removes it (the next demo wipes it too)."""
    keep = ("to keep the Prefect UI up after the summary: make demo ARGS=--keep-running "
            "(python -m ckpt.demo --keep-running); Ctrl-C then stops it")
    disk = (f"left on disk: {fmt_bytes(disk_bytes)} under {data_dir.absolute()}/ (tiers, catalog, logs); "
            f"the next demo wipes it, or: rm -rf {data_dir}")
    lines = [] if kept_running else [keep]
    lines.append(disk)
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    shutil.rmtree(args.dir, ignore_errors=True)
    console.rule("[bold]ckpt-tiering demo")
    console.print(f"starting a Prefect server, moto's S3 server and {len(NODES)} agents under {args.dir}/ ...")
    # promote archives a completed milestone inline; the durable-triggered archive run is only
    # the safety net for an inline archive that failed, which the demo does without
    stack = LocalStack(args.dir, nodes=NODES, port=args.port, archive_trigger=False, limit=args.limit)
    with stack:
        console.print(f"Prefect UI: [bold]{stack.ui_url}[/bold]   (up in {time.monotonic() - t0:.0f} s)")
        steps1 = [100 * (i + 1) for i in range(args.checkpoints)]
        console.print(f"training run {RUN1}: {args.checkpoints} checkpoints of {args.mb} MB, "
                      f"a milestone every {args.milestone_every}")
        saved = train(RUN1, steps1, args)
        base = [r for r in saved if r.milestone][-2] if sum(r.milestone for r in saved) > 1 else saved[-1]
        steps2 = [base.step + 100 * (i + 1) for i in range(args.resumed)]
        console.print(f"training run {RUN2} will resume from {RUN1} step {base.step}: waiting until it is "
                      "durable (a resumed job restores from Tier 1 or 2) ...")
        wait_for_tiers([base], tier2=stack.s3_url is not None, timeout=args.timeout, quiet=True)
        console.print(f"training run {RUN2}, resumed from {RUN1} step {base.step}")
        saved += train(RUN2, steps2, args, resumed_from=(RUN1, base.step))
        console.print("waiting for every checkpoint to reach its tiers ...")
        got = wait_for_tiers(saved, tier2=stack.s3_url is not None, timeout=args.timeout)
        ok = all(s.reached for s in got.values())
        console.print(summary_table(saved, got))
        console.print(lineage(saved))
        durable = [s.durable_at - r.committed_at for r in saved if (s := got[(r.run, r.step)]).durable_at]
        if durable:
            console.print(f"time to durable (Tier 0 commit -> every part verified on Tier 1): median "
                          f"{sorted(durable)[len(durable) // 2]:.1f} s, max {max(durable):.1f} s")
        console.print(("[green]every checkpoint reached its tiers[/green]" if ok else
                       "[red]some checkpoints did not reach their tiers; see the logs under "
                       f"{args.dir}/logs[/red]") + f" (demo took {time.monotonic() - t0:.0f} s)")
        console.print(f"Prefect UI: [bold]{stack.ui_url}[/bold]  (flow runs, events, artifacts)")
        if args.keep_running:
            console.print("keeping the stack up; Ctrl-C to stop")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                console.print("stopping ...")
    for line in closing_lines(args.dir, folder_bytes(args.dir), kept_running=args.keep_running):
        console.print(line, highlight=False, soft_wrap=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the stack was stopped on the way out
        console.print("interrupted; everything stopped")
        sys.exit(130)
