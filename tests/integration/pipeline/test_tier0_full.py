"""No tier fills in the job's face: a save checks Tier 0's free space before it writes, asks
this node's Tier 0 retention for room and waits for it, and otherwise raises ``StorageFull``
with the numbers, having written nothing. Tier 0 here is a real small tmpfs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckpt.space
from ckpt.client import CheckpointStager
from core import checksum, events
from core.errors import StorageFull
from core.manifest import Manifest
from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from tasks import tier0_space
from tasks.register import register_stored_part
from tasks.verify import verify_replica
from tests.kit.checkpoints import replica_states
from tests.kit.pipeline import pipeline_settings
from tests.kit.settings import mark_root
from tests.kit.tmpfs import mounted_tmpfs

RUN = "run-a"
MiB = 1 << 20


def tensors(seed: int) -> dict[str, np.ndarray]:
    """1 MiB: four float32 tensors of 256 KiB."""
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(64 * 1024, dtype=np.float32) for i in range(4)}


@pytest.fixture
def tier0(tmp_path):
    """``tier0(size, tier=0)``: a tmpfs of ``size`` as this node's Tier 0 (or ``tier``), marked as
    its agent's start would, unmounted after the test."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield lambda size, tier=0: mark_root(stack.enter_context(mounted_tmpfs(tmp_path / "nvme", size)), tier)


def intact(folder) -> bool:
    m = Manifest.from_json((folder / "manifest.json").read_bytes())
    return all(checksum.hash_file(folder / f.path) == (f.size, f.checksum) for f in m.files)


def on_tier0_known(settings, step: int) -> None:
    """The node's agent has registered ``step`` and verified it on Tier 0, not promoted it yet."""
    register_stored_part(settings, RUN, step)
    verify_replica(settings, RUN, step, tier=0)


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_full_tier0_raises_storage_full_with_the_numbers_and_writes_nothing(settings_factory, db_url, tier0,
                                                                            background):
    tier0 = tier0("1536k")
    settings = pipeline_settings(settings_factory, db_url, tier0_url=str(tier0), tier0_space_wait_seconds=0)
    with CheckpointStager(RUN, settings=settings, announce=False, background=background) as st:
        first = st.save(100, tensors(1))
        first = first.result() if background else first
        on_tier0_known(settings, 100)

        with pytest.raises(StorageFull) as err:
            st.save(200, tensors(2))

    e = err.value
    assert e.needed > MiB and e.free < e.needed
    assert e.waiting == (1, first.manifest.total_bytes)  # step 100 waits for its promotion
    text = str(e)
    assert "\n" not in text and "needs" in text and "1 checkpoint(s)" in text and "nothing" in text
    assert sorted(p.name for p in (tier0 / RUN).iterdir()) == ["step-00000100"]  # no partial folder, no staging
    assert intact(first.path)
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified"}  # retention dropped nothing unpromoted


def test_a_short_save_waits_for_retention_then_succeeds(settings_factory, db_url, tier0, monkeypatch):
    tier0 = tier0("2560k")
    settings = pipeline_settings(settings_factory, db_url, tier0_url=str(tier0), tier0_space_wait_seconds=60,
                                 retention_tier0=RetentionPolicy(keep_last=1))
    # the node's agent, promoting what this job saved; its own Tier 0 retention left out here,
    # so that only the save's request for room can drop step 100
    agent = settings.model_copy(update={"retention_tier0": RetentionPolicy(enabled=False)})
    monkeypatch.setattr(ckpt.space, "POLL_SECONDS", 0.05)
    passes: list[list[tuple[int, str]]] = []
    real = tier0_space.retain_tier0_here

    def retain(s, *, actor):
        done = real(s, actor=actor)
        passes.append([(a.step, a.outcome) for a in done])
        if len(passes) == 1:  # while the save waits, the agent promotes both
            for step in (100, 200):
                promote(agent, RUN, step, steps=plain_steps())
        return done

    monkeypatch.setattr(tier0_space, "retain_tier0_here", retain)
    with CheckpointStager(RUN, settings=settings, announce=False) as st:
        for step in (100, 200):
            st.save(step, tensors(step))
            on_tier0_known(settings, step)
        saved = st.save(300, tensors(300))

    assert passes[0] == []  # neither promoted yet: nothing may go
    assert passes[1] == [(100, "pruned")] and len(passes) == 2
    assert intact(saved.path)
    assert sorted(p.name for p in (tier0 / RUN).iterdir()) == ["step-00000200", "step-00000300"]
    states = replica_states(settings, RUN, 100)
    assert states[(1, 0)] == "verified" and states[(0, 0)] == "pruned"


def test_low_headroom_is_announced_once_per_crossing(settings_factory, tier0, monkeypatch):
    import shutil

    tier0 = tier0("4m")
    sent: list[dict] = []
    monkeypatch.setattr(events, "post_events", lambda url, batch, **kw: sent.extend(batch))
    settings = settings_factory(tier0_url=str(tier0), tier_low_headroom_checkpoints=2,
                                prefect_api_url="http://127.0.0.1:9/api")
    with CheckpointStager(RUN, settings=settings) as st:
        for step in (100, 200, 300):  # 4 MiB: after 200 fewer than 2 more fit; 300 is still below
            st.save(step, tensors(step))
        for step in (100, 200, 300):  # room again (as retention would make it)
            shutil.rmtree(st.checkpoint_dir(step))
        for step in (400, 500):  # above the line, then across it again
            st.save(step, tensors(step))

    low = [e for e in sent if e["event"] == events.TIER_LOW]
    assert [e["resource"]["ckpt.step"] for e in low] == ["200", "500"]
    res, payload = low[0]["resource"], low[0]["payload"]
    assert res["ckpt.tier"] == "0" and res["ckpt.node"] == "node-0" and res["ckpt.run"] == RUN
    assert payload["threshold"] == 2 and 0 < payload["headroom_checkpoints"] < 2
    assert payload["free_bytes"] < 2 * payload["checkpoint_bytes"]


def test_tier1_low_headroom_is_announced_once_by_the_promotion_that_crosses(settings_factory, db_url, tier0):
    from core.events import announcing
    from tests.kit.checkpoints import write_checkpoint
    from tests.kit.pipeline import Recorder

    tier1 = tier0("4m", tier=1)  # here the small tmpfs is Tier 1
    settings = pipeline_settings(settings_factory, db_url, tier1_url=str(tier1), tier_low_headroom_checkpoints=2.5)
    rec = Recorder()
    with announcing(rec):
        for step in (100, 200, 300):  # 1 MiB each: after 200 fewer than 2.5 more fit
            write_checkpoint(settings.tier0_url, RUN, step, shards=2, shard_bytes=512 * 1024)
            promote(settings, RUN, step, steps=plain_steps())
    low = [s for s in rec.seen if s[0] == events.TIER_LOW]
    assert low == [(events.TIER_LOW, RUN, 200, 0, "tier1")]


def test_room_taken_after_the_check_still_ends_in_storage_full_and_nothing_published(settings_factory, tier0,
                                                                                     monkeypatch):
    tier0 = tier0("1m")
    settings = settings_factory(tier0_url=str(tier0))
    monkeypatch.setattr(ckpt.space.Tier0Space, "ensure_room", lambda self, *a, **kw: 0)  # another writer won
    with CheckpointStager(RUN, settings=settings, announce=False) as st, pytest.raises(StorageFull) as err:
        st.save(100, tensors(1) | tensors(2) | {"extra": np.zeros(256 * 1024, dtype=np.float32)})
    assert "nothing was published" in str(err.value) and "\n" not in str(err.value)
    assert list((tier0 / RUN).iterdir()) == []  # the staging folder went too


def test_without_a_catalog_the_save_still_fails_cleanly_with_the_numbers(settings_factory, tier0):
    tier0 = tier0("1m")
    settings = settings_factory(tier0_url=str(tier0), tier0_space_wait_seconds=0)  # catalog never created
    with CheckpointStager(RUN, settings=settings, announce=False) as st, pytest.raises(StorageFull) as err:
        st.save(100, tensors(1) | {"extra": np.zeros(256 * 1024, dtype=np.float32)})
    assert err.value.waiting is None and "not known" in str(err.value)
    assert err.value.free <= MiB < err.value.needed
    assert not (tier0 / RUN).exists() or list((tier0 / RUN).iterdir()) == []


def test_ckpt_commit_of_a_folder_on_another_disk_checks_room_before_copying(settings_factory, tier0, tmp_path):
    from safetensors.numpy import save_file

    from ckpt.commit import commit_folder

    tier0 = tier0("1m")
    settings = settings_factory(tier0_url=str(tier0), tier0_space_wait_seconds=0)
    job = tmp_path / "job-out"  # not the tmpfs: its files would be copied, not linked
    job.mkdir()
    save_file(tensors(1) | {"extra": np.zeros(256 * 1024, dtype=np.float32)}, str(job / "model.safetensors"))
    with pytest.raises(StorageFull, match="run-a step 7 needs"):
        commit_folder(job, RUN, 7, settings, announce=False)
    assert not (tier0 / RUN).exists() or list((tier0 / RUN).iterdir()) == []
    assert (job / "model.safetensors").is_file()  # the job's own folder as it was


def test_the_wait_for_room_is_bounded_by_the_setting(settings_factory, tier0, monkeypatch):
    import time

    tier0 = tier0("1m")
    settings = settings_factory(tier0_url=str(tier0), tier0_space_wait_seconds=0.5)
    monkeypatch.setattr(ckpt.space, "POLL_SECONDS", 0.05)
    passes = []
    monkeypatch.setattr(tier0_space, "retain_tier0_here", lambda s, *, actor: passes.append(actor) or [])
    t0 = time.monotonic()
    with CheckpointStager(RUN, settings=settings, announce=False) as st, pytest.raises(StorageFull) as err:
        st.save(100, tensors(1) | {"extra": np.zeros(256 * 1024, dtype=np.float32)})
    waited = time.monotonic() - t0
    assert 0.5 <= waited < 30 and len(passes) >= 2 and set(passes) == {"stager:node-0"}
    assert "tier0_space_wait_seconds=0.5" in str(err.value)

    off = settings.model_copy(update={"retention_tier0": RetentionPolicy(enabled=False)})
    passes.clear()
    with CheckpointStager(RUN, settings=off, announce=False) as st, \
            pytest.raises(StorageFull, match="retention is off"):
        st.save(100, tensors(1) | {"extra": np.zeros(256 * 1024, dtype=np.float32)})
    assert len(passes) == 1  # a look, no wait: nothing would free it


KILLED_MID_SAVE = """
import os, signal
from pathlib import Path

import numpy as np
import ckpt.client
def killed(staging, final, manifest):  # every shard written, nothing published yet
    os.kill(os.getpid(), signal.SIGKILL)
ckpt.client.publish_folder = killed
from core.settings import load_settings
rng = np.random.default_rng(7)
with ckpt.client.CheckpointStager(%r, settings=load_settings(), announce=False) as st:
    st.save(%d, {f"layer{i}.weight": rng.standard_normal(64 * 1024, dtype=np.float32) for i in range(4)})
"""


def save_killed_midway(settings, step: int) -> Path:
    """A save of 1 MiB in its own process, SIGKILLed once its shards are in the staging folder;
    that folder, left behind."""
    import os
    import signal
    import subprocess
    import sys

    from core.layout import is_staging

    env = {**os.environ, "CKPT_DATA_DIR": str(settings.data_dir), "CKPT_NODE": settings.node,
           "CKPT_CATALOG_URL": settings.catalog_url, "CKPT_TIER0_URL": settings.tier0_url}
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE % (RUN, step)], env=env, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [p for p in (Path(settings.tier0_url) / RUN).iterdir() if is_staging(p.name)]
    assert len(left) == 1 and sum(f.stat().st_size for f in left[0].rglob("*")) > MiB - 4096
    return left[0]


def test_a_save_killed_midway_does_not_hold_tier0_room_for_the_next_one(settings_factory, db_url, tier0):
    """A writer SIGKILLed after its shards were staged leaves its staging folder; the next save's
    room check sweeps it (its pid is gone on this node) and the save succeeds."""
    tier0 = tier0("1536k")
    settings = pipeline_settings(settings_factory, db_url, tier0_url=str(tier0), tier0_space_wait_seconds=0)
    dead = save_killed_midway(settings, 100)

    with CheckpointStager(RUN, settings=settings, announce=False) as st:
        saved = st.save(200, tensors(2))

    assert not dead.exists() and intact(saved.path)
    assert sorted(p.name for p in (tier0 / RUN).iterdir()) == ["step-00000200"]


def test_reconcile_sweeps_the_staging_of_a_killed_save(settings_factory, db_url):
    from flows.common import plain_steps
    from flows.reconcile import reconcile_once

    settings = pipeline_settings(settings_factory, db_url)
    dead = save_killed_midway(settings, 100)

    report = reconcile_once(settings, steps=plain_steps())

    assert not dead.exists() and report.failed == []
    assert any("staging folder(s) of dead writers" in r for r in report.recovered), report.recovered


def test_storage_full_says_what_holds_the_room(settings_factory, db_url, tier0):
    """A live writer's staging folder (this process's) is never swept, and the error names it."""
    from core.layout import staging_name

    tier0 = tier0("1536k")
    settings = pipeline_settings(settings_factory, db_url, tier0_url=str(tier0), tier0_space_wait_seconds=0)
    live = tier0 / RUN / staging_name("step-00000100")
    live.mkdir(parents=True)
    (live / "model.safetensors").write_bytes(b"\0" * MiB)

    with CheckpointStager(RUN, settings=settings, announce=False) as st, pytest.raises(StorageFull) as err:
        st.save(200, tensors(2))

    text = str(err.value)
    assert "1 staging folder(s) of live writers (1.05 MB)" in text and "0 checkpoint(s)" in text, text
    assert live.is_dir() and (live / "model.safetensors").stat().st_size == MiB
