"""The two-rank kill-wipe-resume of the recovery page through Lightning (real ``lightning``
Trainer, two processes on CPU, gloo, ``TieringModelParallelStrategy``; real promotion as plain
functions, both catalogs): attempt A saves every 2 steps and both ranks are killed after step 6,
node-1's step-6 part never promoted; node-1's Tier 0 is wiped (a replaced node). Attempt B
resumes both ranks with ``trainer.fit(model, ckpt_path=strategy.resume_path())`` from the step
whose parts all have a good copy, re-trains on other data and saves steps 6 and 8 again without
a conflict. The model B resumed with is the one A saved at that step; the next resume and the
drill see only checkpoints whose parts share one attempt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.kit.require import require_module

require_module("lightning")

import torch  # noqa: E402

from tests.kit.restore import on_node, scenario_settings  # noqa: E402

RUN = "lit-resume"  # tests.kit.lightning_sharded_resume_job's run
JOB = "tests.kit.lightning_sharded_resume_job"

pytestmark = pytest.mark.timeout(240)


def _launch(nodes, out: Path, attempt: str, max_steps: int, kill_at: int | None = None, *,
            expected: int | None = None, node_env: dict[int, dict[str, str]] | None = None) -> list[str]:
    """The job's nodes as ``attempt``; each must end with ``expected`` (default: 0, or SIGKILL's
    -9 with ``kill_at``). Their outputs."""
    from tests.kit.lightning import run_nodes

    args = [str(out), attempt, str(max_steps), *([str(kill_at)] if kill_at is not None else [])]
    done = run_nodes(JOB, args, nodes, node_env=node_env)
    if expected is None:
        expected = -9 if kill_at is not None else 0
    assert [rc for rc, _ in done] == [expected] * len(nodes), "".join(o[-3000:] for _, o in done)
    return [o for _, o in done]


def _promote(nodes, step: int, attempt: str, *, ranks: tuple[int, ...] | None = None) -> None:
    """Each node of ``ranks`` (default: all) promotes its part of ``step`` of a ``len(nodes)``-node job."""
    from flows.common import plain_steps
    from flows.promote import promote

    for rank in range(len(nodes)) if ranks is None else ranks:
        promote(nodes[rank], RUN, step, rank, len(nodes), steps=plain_steps(), actor="test", attempt=attempt)


def _manifest_attempts(folder: str) -> set[str]:
    return {json.loads(m.read_text())["attempt"] for m in Path(folder).glob("manifest*.json")}


def _resumed_as_saved(out: Path, attempt: str, saved_by: str, step: int) -> bool:
    """Whether ``attempt`` resumed at ``step`` with the model ``saved_by`` saved there."""
    resumed, saved = torch.load(out / f"resumed-{attempt}.pt"), torch.load(out / f"saved-{saved_by}-{step}.pt")
    return (resumed["step"] == step and resumed["state"].keys() == saved.keys()
            and all(torch.equal(resumed["state"][k], saved[k]) for k in saved))


def test_two_ranks_killed_wiped_and_resumed_through_lightning(settings_factory, db_url, tmp_path):
    from ckpt.resume import resume_point
    from db.catalog import Catalog
    from db.entities import CKPT_COMMITTED
    from tasks.drill import cluster_drill
    from tasks.tier_roots import init_tier

    settings = scenario_settings(settings_factory, db_url)
    nodes = [on_node(settings, f"node-{rank}") for rank in (0, 1)]
    out = tmp_path / "out"
    out.mkdir()

    outputs = _launch(nodes, out, "A", max_steps=10, kill_at=7)
    assert all("resume None" in o and "committed [2, 4, 6]" in o for o in outputs), "".join(o[-3000:] for o in outputs)
    for step in (2, 4):
        _promote(nodes, step, "A")
    _promote(nodes, 6, "A", ranks=(0,))  # node-1 died before it promoted its part of step 6
    tier0 = Path(nodes[1].tier0_url.removeprefix("file://"))
    shutil.rmtree(tier0)  # node-1 replaced: a new, empty NVMe
    tier0.mkdir()
    init_tier(nodes[1], 0, actor="operator", replace=True)

    outputs = _launch(nodes, out, "B", max_steps=8)
    assert all("committed [6, 8]" in o for o in outputs)
    assert _resumed_as_saved(out, "B", "A", 4), "step 4, the newest whose parts are all good, as A saved it"
    again_a, again_b = torch.load(out / "saved-A-6.pt"), torch.load(out / "saved-B-6.pt")
    assert not all(torch.equal(again_a[k], again_b[k]) for k in again_a), "the re-training gave other bytes"

    for step in (6, 8):
        _promote(nodes, step, "B")
    with Catalog(settings.catalog_url) as cat:
        live, old = cat.get_checkpoint(RUN, 6), cat.get_checkpoint(RUN, 6, "A")
        assert (live.attempt, live.state, live.parts_registered) == ("B", CKPT_COMMITTED, 2)
        assert (old.superseded_by, old.parts_registered) == ("B", 1)  # A's part 0 only: never offered
        newest = cat.newest_verified(RUN)
        assert (newest.step, newest.attempt) == (8, "B")

    points = [resume_point(RUN, part=rank, parts=2, settings=node, attempt="C") for rank, node in enumerate(nodes)]
    assert [p.step for p in points] == [8, 8]
    assert [_manifest_attempts(p.path) for p in points] == [{"B"}, {"B"}]

    drills, skipped = cluster_drill(settings, run=RUN, tiers=(1,), scratch=tmp_path / "drills")
    assert skipped == []
    [drill] = drills
    assert (drill.result.step, drill.result.ok, drill.result.nodes) == (8, True, 2)


def test_a_relaunch_on_fewer_nodes_resumes_the_checkpoint_of_more(settings_factory, sqlite_url, tmp_path):
    """A relaunch whose nodes were not all given ``resume_path`` (node-1 a folder of its own) is
    stopped on both ranks before they load anything. Then node-1 is gone for good and the job
    is relaunched on node-0 alone: its ``resume_path`` brings the whole two-part checkpoint (DCP
    reshards it on load), and the one rank trains on from it and saves its one-part checkpoints."""
    from core.layout import checkpoint_dirname
    from db.catalog import Catalog

    settings = scenario_settings(settings_factory, sqlite_url)
    nodes = [on_node(settings, f"node-{rank}") for rank in (0, 1)]
    out = tmp_path / "out"
    out.mkdir()
    _launch(nodes, out, "A", max_steps=4)
    for step in (2, 4):
        _promote(nodes, step, "A")

    own = {1: {"CKPT_TEST_CKPT_PATH": str(Path(settings.tier1_url) / RUN / checkpoint_dirname(2, "A"))}}
    outputs = _launch(nodes, out, "X", max_steps=6, expected=1, node_env=own)
    assert all("the ranks resume from different checkpoints (step 4, another path, by global rank)" in o
               for o in outputs)
    assert not (out / "resumed-X.pt").exists(), "no rank trained"

    outputs = _launch(nodes[:1], out, "B", max_steps=6)
    assert "committed [6]" in outputs[0]
    assert _resumed_as_saved(out, "B", "A", 4)
    _promote(nodes[:1], 6, "B")
    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(RUN, 6)
        assert (ck.attempt, ck.parts, ck.state) == ("B", 1, "committed")
