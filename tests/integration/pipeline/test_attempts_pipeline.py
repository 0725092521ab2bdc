"""The two-rank kill-wipe-resume of the recovery page, through the plain client and the real
pipeline (plain functions, both catalogs): ranks on node-0 and node-1 save every 5 steps, both
are killed after step 37 with node-1's last parts never promoted, node-1's Tier 0 is wiped (a
replaced node); both resume from step 20 and re-train with other bytes. The re-saves never
conflict, no checkpoint is made of two attempts, and the next resume, ``latest`` and retention
see only checkpoints whose parts share one attempt."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ckpt.client import CheckpointStager
from ckpt.resume import resume_point
from core.attempt import launch_attempt
from core.errors import BadInput, NotFound
from core.manifest import Manifest
from db.catalog import Catalog
from db.entities import CKPT_COMMITTED, CKPT_RETIRED, CKPT_SUPERSEDED
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tasks.drill import cluster_drill
from tasks.restore import restore_checkpoint
from tasks.tier_roots import init_tier
from tests.kit.restore import on_node, scenario_settings

RUN = "llm"


def _stager(settings, rank: int, attempt: str) -> CheckpointStager:
    return CheckpointStager(RUN, settings=settings, part=rank, parts=2, announce=False, attempt=attempt)


def _tensors(step: int, rank: int, seed: int) -> dict:
    rng = np.random.default_rng(seed * 1000 + step * 10 + rank)  # the re-training is not bit-identical
    return {"w": rng.standard_normal(256).astype(np.float32)}


def _promote(settings, step: int, rank: int, attempt: str):
    return promote(settings, RUN, step, rank, 2, steps=plain_steps(), actor="test", attempt=attempt)


@pytest.fixture
def nodes(settings_factory, db_url):
    base = scenario_settings(settings_factory, db_url)
    return on_node(base, "node-0"), on_node(base, "node-1")


def _first_attempt(nodes) -> None:
    """Attempt A: 5..35 saved by both ranks; rank 0 promoted all, rank 1 only up to 20."""
    for rank, settings in enumerate(nodes):
        with _stager(settings, rank, "A") as st:
            for step in range(5, 40, 5):
                st.save(step, _tensors(step, rank, seed=1))
                if rank == 0 or step <= 20:
                    _promote(settings, step, rank, "A")
    tier0 = Path(nodes[1].tier0_url.removeprefix("file://"))
    shutil.rmtree(tier0)  # node-1 replaced: a new, empty NVMe, which shows no identity marker yet
    tier0.mkdir()
    init_tier(nodes[1], 0, actor="operator", replace=True)  # `ckpt tiers init --tier 0 --replace` on it


def test_both_ranks_resume_and_resave_with_other_bytes(nodes):
    _first_attempt(nodes)
    points = [resume_point(RUN, part=rank, parts=2, settings=s, attempt="B") for rank, s in enumerate(nodes)]
    assert [p.step for p in points] == [20, 20]
    for rank, settings in enumerate(nodes):
        with _stager(settings, rank, "B") as st:
            for step in (25, 30):  # no ConflictError on rank 0, whose Tier 0 holds A's 25 and 30
                saved = st.save(step, _tensors(step, rank, seed=2))
                assert saved.path.name == f"step-{step:08d}@B"
                _promote(settings, step, rank, "B")
    with Catalog(nodes[0].catalog_url) as cat:
        for step in (25, 30):
            live, old = cat.get_checkpoint(RUN, step), cat.get_checkpoint(RUN, step, "A")
            assert (live.attempt, live.state, live.parts_registered) == ("B", CKPT_COMMITTED, 2)
            # superseded, then retired by the retention that follows B's durable checkpoint
            assert (old.state, old.superseded_by, old.parts_registered) == (CKPT_RETIRED, "B", 1)
        assert cat.get_checkpoint(RUN, 35).superseded_by == "B"  # A's part 0 only: never offered
        newest = cat.newest_verified(RUN)
        assert (newest.step, newest.attempt) == (30, "B")
    again = [resume_point(RUN, part=rank, parts=2, settings=s, attempt="C") for rank, s in enumerate(nodes)]
    assert [p.step for p in again] == [30, 30]
    assert all("@B" in str(p.path) for p in again)
    drills, skipped = cluster_drill(nodes[0], run=RUN, tiers=(1,), scratch=nodes[0].data_dir / "drills")
    assert skipped == []
    [drill] = drills  # the drill too takes B's 30, whole from one attempt
    assert (drill.result.step, drill.result.ok, drill.result.nodes) == (30, True, 2)
    folder = Path(nodes[0].tier1_url.removeprefix("file://")) / RUN / f"step-{drill.result.step:08d}@B"
    drilled = [Manifest.from_json(p.read_bytes()) for p in sorted(folder.glob("manifest.part-*.json"))]
    assert [(m.part, m.attempt) for m in drilled] == [(0, "B"), (1, "B")]


def test_a_part_of_the_killed_attempt_found_late_is_never_joined(nodes):
    _first_attempt(nodes)
    for rank, s in enumerate(nodes):
        resume_point(RUN, part=rank, parts=2, settings=s, attempt="B")
    with _stager(nodes[1], 1, "A") as late:  # the killed attempt's rank 1 wrote 40 after all (a slow disk)
        late.save(40, _tensors(40, 1, seed=1))
    with _stager(nodes[0], 0, "A") as late0:
        late0.save(40, _tensors(40, 0, seed=1))
    reconcile_once(nodes[1], steps=plain_steps(), actor="test", grace_seconds=0)
    reconcile_once(nodes[0], steps=plain_steps(), actor="test", grace_seconds=0)
    with Catalog(nodes[0].catalog_url) as cat:
        ck = cat.get_checkpoint(RUN, 40)
        assert (ck.attempt, ck.state, ck.parts_registered) == ("A", CKPT_SUPERSEDED, 2)
        assert not cat.replicas(ck.id, 1)  # never copied on: nothing resumes from it
        assert cat.newest_verified(RUN).step == 20
    with pytest.raises(NotFound, match="superseded by attempt B"):
        restore_checkpoint(nodes[0], RUN, nodes[0].data_dir / "restored", step=35)


def test_a_run_name_reused_without_resuming_is_refused(nodes):
    _first_attempt(nodes)
    with _stager(nodes[0], 0, "other-job") as st:
        st.save(10, _tensors(10, 0, seed=9))
        with pytest.raises(Exception, match=r"never resumed.*reused by mistake"):
            _promote(nodes[0], 10, 0, "other-job")
        st.save(45, _tensors(45, 0, seed=9))  # above anything attempt A saved: refused all the same
        with pytest.raises(Exception, match=r"never resumed.*reused by mistake"):
            _promote(nodes[0], 45, 0, "other-job")
    with Catalog(nodes[0].catalog_url) as cat:
        assert cat.get_checkpoint(RUN, 10).attempt == "A"
        assert [ck.attempt for ck in cat.list_checkpoints(RUN) if ck.step == 45] == []
        assert cat.newest_verified(RUN).attempt == "A"
        assert {r.step for r in cat.rejections(RUN) if "reused by mistake" in r.reason} >= {10, 45}


def test_a_job_reusing_a_run_name_is_stopped_at_its_next_save(nodes):
    """The training side hears the refusal too: after its first save the job's announcer asks
    the catalog once, and the next save raises the catalog's reason, writing nothing."""
    import time

    from core.errors import ConflictError

    _first_attempt(nodes)
    with CheckpointStager(RUN, settings=nodes[0], part=0, parts=2, attempt="other-job") as st:
        st.save(10, _tensors(10, 0, seed=9))
        step, deadline = 15, time.monotonic() + 60
        with pytest.raises(ConflictError, match=r"never resumed.*reused by mistake"):
            while time.monotonic() < deadline:  # the announcer's answer comes off the training thread
                step += 5
                st.save(step, _tensors(step, 0, seed=9))
                time.sleep(0.1)
        assert not st.checkpoint_dir(step).exists()


def test_a_resumed_job_is_never_stopped_by_the_attempt_check(nodes):
    """The check comes off the training thread (and a stager that closes asks nothing more), so
    the test waits for its answer, then saves again: a save after the check is never refused."""
    import time

    _first_attempt(nodes)
    resume_point(RUN, part=0, parts=2, settings=nodes[0], attempt="B")
    with CheckpointStager(RUN, settings=nodes[0], part=0, parts=2, attempt="B") as st:
        for step in (25, 30, 35):
            st.save(step, _tensors(step, 0, seed=3))
        deadline = time.monotonic() + 60
        while not st._announcer.registration.attempt_checked and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st._announcer.registration.attempt_checked
        st.save(40, _tensors(40, 0, seed=3))
    assert st._announcer.registration.refused is None
    assert st.checkpoint_dir(40).exists()


def test_retention_retires_superseded_checkpoints_once_the_new_attempt_is_durable(nodes):
    from tasks.prune import prune_replica
    from tasks.retention import apply_retention, plan_retention

    _first_attempt(nodes)
    for rank, s in enumerate(nodes):
        resume_point(RUN, part=rank, parts=2, settings=s, attempt="B")
    with _stager(nodes[1], 1, "B") as st1:
        st1.save(25, _tensors(25, 1, seed=2))  # on Tier 0 only: B has nothing durable yet
    plan = plan_retention(nodes[0], run=RUN, explain=True)
    held = [a for a in plan if a.step == 30 and a.attempt == "A"]
    assert held and all("no durable checkpoint yet" in a.detail for a in held)
    with _stager(nodes[0], 0, "B") as st0:
        st0.save(25, _tensors(25, 0, seed=2))
    for rank, s in enumerate(nodes):
        _promote(s, 25, rank, "B")
    apply_retention(nodes[0], plan_retention(nodes[0], run=RUN), prune=prune_replica, actor="test")
    with Catalog(nodes[0].catalog_url) as cat:
        for step in (25, 30, 35):
            old = cat.get_checkpoint(RUN, step, "A")
            assert old.state == CKPT_RETIRED
            assert not [r for r in cat.replicas(old.id) if r.state == "verified"]
        assert cat.get_checkpoint(RUN, 25).state == CKPT_COMMITTED
    assert not list(Path(nodes[1].tier1_url.removeprefix("file://")).glob(f"{RUN}/step-00000030@A"))


def test_the_attempt_comes_from_the_launcher():
    assert launch_attempt("mine", {"CKPT_ATTEMPT": "env"}) == "mine"
    assert launch_attempt(None, {"CKPT_ATTEMPT": "env", "SLURM_JOB_ID": "7"}) == "env"
    te = {"TORCHELASTIC_RUN_ID": "job/42", "TORCHELASTIC_RESTART_COUNT": "3", "SLURM_JOB_ID": "7"}
    assert launch_attempt(None, te) == "te-job-42-r3"
    assert launch_attempt(None, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}) \
        == "slurm-7-r1"
    assert launch_attempt(None, {}) == ""
    long = launch_attempt(None, {"TORCHELASTIC_RUN_ID": "x" * 200})
    assert len(long) <= 64 and long != launch_attempt(None, {"TORCHELASTIC_RUN_ID": "x" * 199})
    with pytest.raises(BadInput):
        launch_attempt("../escape")
