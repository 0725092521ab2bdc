"""A refused part is a recorded state: judged once per manifest, not on every reconcile pass.

Before, each reconcile pass promoted a refused part again: one more audit row and one more
``ckpt.checkpoint.rejected`` event a minute, forever, and the checkpoint never became
``rejected``. Its Tier 0 bytes are kept (never delete the only copy silently)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from core.errors import BadInput
from core.events import announcing
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import ckpt_dir, open_catalog as catalog, replica_states, same_bytes, write_checkpoint
from tests.kit.pipeline import Recorder, pipeline_settings
from tests.kit.restore import on_node

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url)


def rejects(settings, step: int) -> int:
    cat = catalog(settings)
    try:
        return sum(1 for e in cat.history(RUN, step) if e.action == "reject")
    finally:
        cat.close()


def checkpoint_state(settings, step: int) -> str:
    cat = catalog(settings)
    try:
        return cat.get_checkpoint(RUN, step).state
    finally:
        cat.close()


def test_a_malformed_part_is_rejected_once_and_a_resave_is_judged_afresh(settings):
    node1 = on_node(settings, "node-1")
    write_checkpoint(settings.tier0_url, RUN, 100, part=0, parts=2, node="node-0")
    write_checkpoint(node1.tier0_url, RUN, 100, part=1, parts=2, node="node-1")
    promote(settings, RUN, 100, 0, 2, steps=plain_steps())
    manifest = ckpt_dir(node1.tier0_url, RUN, 100) / "manifest.part-00001-of-00002.json"
    good = manifest.read_bytes()
    manifest.write_bytes(json.dumps({**json.loads(good), "format": "pickle-of-doom"}).encode())
    events = Recorder()

    with announcing(events):
        first = reconcile_once(node1, steps=plain_steps())
    with announcing(events):
        passes = [reconcile_once(node1, steps=plain_steps()) for _ in range(3)]

    assert any("BadInput" in f for f in first.failed)
    assert rejects(settings, 100) == 1 and events.names().count("rejected") == 1
    assert all(p.failed == [] and p.promoted == [] for p in passes)
    assert all(any("part 1: rejected" in s for s in p.skipped) for p in passes)
    assert checkpoint_state(settings, 100) == "rejected"
    # a duplicate event: refused, not re-judged
    with pytest.raises(BadInput, match="rejected at"), announcing(events):
        promote(node1, RUN, 100, 1, 2, steps=plain_steps())
    assert rejects(settings, 100) == 1 and events.names().count("rejected") == 1
    assert (ckpt_dir(node1.tier0_url, RUN, 100) / "model-p01-00000.safetensors").is_file()  # bytes kept

    manifest.write_bytes(good)  # the job saves the part again, correctly
    with announcing(events):
        again = reconcile_once(node1, steps=plain_steps())

    assert again.promoted == [f"{RUN}/100 part 1"]
    assert checkpoint_state(settings, 100) == "committed"
    assert replica_states(settings, RUN, 100)[(1, 1)] == "verified"
    assert "durable" in events.names()


def test_a_conflicting_resave_is_rejected_once_and_the_accepted_checkpoint_stands(settings):
    write_checkpoint(settings.tier0_url, RUN, 100)
    plain_steps().register(settings, RUN, 100, 0, 1)  # registered; its event's promotion was lost
    shutil.rmtree(ckpt_dir(settings.tier0_url, RUN, 100))
    write_checkpoint(settings.tier0_url, RUN, 100, seed=7)  # another save of the same step
    events = Recorder()

    with announcing(events):
        first = reconcile_once(settings, steps=plain_steps())
    with announcing(events):
        later = [reconcile_once(settings, steps=plain_steps()) for _ in range(3)]

    assert any("ConflictError" in f for f in first.failed)
    assert all(p.failed == [] and p.promoted == [] for p in later)
    assert rejects(settings, 100) == 1 and events.names().count("rejected") == 1
    assert checkpoint_state(settings, 100) == "committed"  # what was accepted is not what is bad
    assert replica_states(settings, RUN, 100).get((1, 0)) is None  # the conflicting bytes were never copied
    cat = catalog(settings)
    try:
        (rej,) = cat.rejections(RUN)
        assert (rej.step, rej.part) == (100, 0) and "ConflictError" in rej.reason
    finally:
        cat.close()


def test_a_part_whose_files_are_another_parts_is_rejected_at_registration(settings, tmp_path):
    """Two nodes commit their part of one checkpoint with the same file name (``model.safetensors``
    each, as ``ckpt commit DIR --part i --parts 2`` on every node): the second part to register is
    refused with a recorded reason naming the file, before a byte of it reaches Tier 1; the first
    part's copy there stands."""
    from safetensors.numpy import save_file

    from ckpt.commit import commit_folder
    from core.errors import ConflictError

    node1 = on_node(settings, "node-1")
    for part, node in enumerate((settings, node1)):
        job = tmp_path / f"job-{part}"
        job.mkdir()
        save_file({f"layer{part}.weight": np.full(1024, part, dtype=np.float32)}, str(job / "model.safetensors"))
        commit_folder(job, RUN, 100, node, part=part, parts=2, announce=False)
    promote(settings, RUN, 100, 0, 2, steps=plain_steps())
    events = Recorder()

    refused = r"'model\.safetensors' is also a file of part 0, with other bytes"
    with pytest.raises(ConflictError, match=refused), announcing(events):
        promote(node1, RUN, 100, 1, 2, steps=plain_steps())

    cat = catalog(settings)
    try:
        (rej,) = cat.rejections(RUN)
        assert (rej.step, rej.part, rej.node) == (100, 1, "node-1")
        assert "different relative paths" in rej.reason
    finally:
        cat.close()
    assert events.names() == ["rejected"]


def test_a_job_whose_part_was_refused_for_a_colliding_path_is_stopped_at_a_later_save(settings, tmp_path):
    """The training side hears that refusal too: node-1's job adopts its folders through a
    stager; once its part of step 100 is refused (a path part 0 holds with other bytes), its
    announcer finds the rejection, and a later save raises it, writing nothing: every save of
    that layout would be refused alike."""
    import time

    from safetensors.numpy import save_file

    from ckpt.client import CheckpointStager
    from core.errors import ConflictError

    node1 = on_node(settings, "node-1")

    def job_folder(part: int, step: int):
        job = tmp_path / f"job-{part}-{step}"
        job.mkdir()
        save_file({f"layer{part}.weight": np.full(1024, part + step, dtype=np.float32)},
                  str(job / "model.safetensors"))
        return job

    with CheckpointStager(RUN, settings=settings, part=0, parts=2) as rank0:
        rank0.save(100, job_folder(0, 100))
    promote(settings, RUN, 100, 0, 2, steps=plain_steps())
    with CheckpointStager(RUN, settings=node1, part=1, parts=2) as rank1:
        rank1.save(100, job_folder(1, 100))
        with pytest.raises(ConflictError):
            promote(node1, RUN, 100, 1, 2, steps=plain_steps())
        step, deadline = 100, time.monotonic() + 60
        with pytest.raises(ConflictError, match=r"refused run-a step 100 part 1: CollidingPaths: .*model\.safetensors"):
            while time.monotonic() < deadline:  # the announcer asks off the training thread
                step += 100
                rank1.save(step, job_folder(1, step))
                time.sleep(0.2)
        assert not rank1.checkpoint_dir(step).exists()
    assert checkpoint_state(settings, 100) == "rejected"
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}, "part 1 never copied"
    on_tier1 = ckpt_dir(settings.tier1_url, RUN, 100) / "model.safetensors"
    assert same_bytes(on_tier1, ckpt_dir(settings.tier0_url, RUN, 100) / "model.safetensors")


@pytest.mark.parametrize(("reason", "stops"), [
    ("CollidingPaths: its file 'model.safetensors' is also a file of part 0, with other bytes", True),
    ("ReusedRunName: attempt x never resumed", True),
    ("ConflictError: part 0 is already registered with a different manifest", False),
    ("CorruptCheckpoint: shard-0 crc32c differs", False)])
def test_only_a_refusal_every_later_save_would_meet_stops_the_job(settings, reason, stops):
    """A step saved again with other bytes, or a copy found corrupt, is that checkpoint's
    refusal: the job goes on (the next save is a new chance). A colliding layout or a reused
    run name would refuse every later save too: the next save raises it."""
    import time
    from collections import deque

    from ckpt.announce import RunRegistration, ask_catalog
    from tests.kit.catalog import manifest

    m = manifest(RUN, 100)
    cat = catalog(settings)
    try:
        cat.ensure_run(RUN)
        cat.reject_part(RUN, 100, 0, digest=m.digest(), reason=reason, actor="test")
    finally:
        cat.close()
    reg = RunRegistration(RUN, None, None, "resumed_from")
    sent = deque([(m, m.digest(), time.monotonic())])
    ask_catalog(settings, reg, sent, None)
    assert not sent  # answered: asked after no more
    assert (reg.refused is not None) == stops
    if stops:
        assert reason in reg.refused
