"""One flow run per checkpoint, the one promotion path: the node's agent promotes each part on
its event with no run (``flows.promote.promote_in_agent``, run by
``deployments.part_events.PartEvents``), and the part that completes the checkpoint asks for
its one run, which takes the follow-ups.

What a user checks: every part lands verified on Tier 1; the checkpoint's run is asked for by the
completing part, whatever the order (an event repeated while its follow-ups are open asks for the
same run again); the run asked for makes the checkpoint durable (retention included) as a promote
run does; a malformed event and a corrupt part are recorded and the next event is still served; a
crash between the completion and the request leaves the follow-ups to the checkpoint's next event
or reconcile. Real catalog (SQLite and PostgreSQL), real tiers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from core.errors import BadEvent, CorruptCheckpoint
from core.events import announcing
from core.settings import RetentionPolicy
from deployments.part_events import PartEvents
from flows.common import plain_steps
from flows.promote import followups_key, promote, promote_in_agent
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import ckpt_dir, flip_bit, open_catalog, replica_states, write_checkpoint
from tests.kit.pipeline import Recorder, pipeline_settings

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1))


def event(step: int, part: int = 0, parts: int = 2, **extra) -> dict:
    """A completed event's payload as the training job sends it."""
    return {"run": RUN, "step": step, "part": part, "parts": parts, "node": "node-0", **extra}


def commit(settings, step: int, parts: int = 2) -> None:
    for p in range(parts):
        write_checkpoint(settings.tier0_url, RUN, step, part=p, parts=parts, shards=2, shard_bytes=64 << 10)


def audits(settings, step: int, action: str) -> int:
    with open_catalog(settings) as cat:
        return sum(e.action == action for e in cat.history(RUN, step))


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["in-order", "reversed"])
def test_parts_are_promoted_without_a_run_and_the_completing_part_asks_for_the_checkpoints_run_once(
        settings, order):
    commit(settings, 100)
    asked: list[tuple] = []
    recorder = Recorder()

    with announcing(recorder):
        first = promote_in_agent(settings, event(100, order[0]), request_followups=lambda *a: asked.append(a))
        assert asked == [] and not first.durable  # one part on Tier 1: nothing to follow up yet
        promote_in_agent(settings, event(100, order[1]), request_followups=lambda *a: asked.append(a))
        for p in (0, 1, 1, 0):  # duplicates (a replayed subscription, a retried send) while the run is
            promote_in_agent(settings, event(100, p), request_followups=lambda *a: asked.append(a))  # not done

    assert asked[0] == (RUN, 100, order[1], 2, "")  # by the completing part
    # a duplicate that finds the follow-ups open asks again: the same run (one idempotency key)
    assert {followups_key(a[0], a[1], a[4]) for a in asked} == {followups_key(RUN, 100)}
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (0, 1): "verified",
                                                  (1, 0): "verified", (1, 1): "verified"}
    assert audits(settings, 100, "complete") == 1
    assert recorder.names().count("promoted") >= 2  # the hops' facts announced, as in a promote run
    assert "durable" not in recorder.names()  # the follow-ups are the checkpoint run's
    assert audits(settings, 100, "followups-done") == 0


def test_the_checkpoints_run_takes_the_follow_ups_once(settings):
    commit(settings, 100)
    commit(settings, 200)
    asked: list[tuple] = []
    for step in (100, 200):
        for p in (0, 1):
            promote_in_agent(settings, event(step, p), request_followups=lambda *a: asked.append(a))
    assert [a[:2] for a in asked] == [(RUN, 100), (RUN, 200)]

    for run, step, part, parts, attempt in asked:  # what the requested promote run does (flows.promote)
        recorder = Recorder()
        with announcing(recorder):
            result = promote(settings, run, step, part, parts, steps=plain_steps(), attempt=attempt)
        assert result.durable and recorder.names().count("durable") == 1
        assert result.hops[0].skipped  # the part was already on Tier 1: nothing copied again
    again = promote(settings, RUN, 200, 1, 2, steps=plain_steps())  # the same run retried: nothing re-runs

    assert not again.durable
    assert audits(settings, 200, "followups-done") == 1
    # retention ran in the checkpoint's run: Tier 0 keeps 1, so step 100 left the node
    assert {v for (tier, _), v in replica_states(settings, RUN, 100).items() if tier == 0} == {"pruned"}
    assert not [f for f in ckpt_dir(settings.tier0_url, RUN, 100).rglob("*") if f.is_file()]


def test_a_crash_between_the_completion_and_the_request_leaves_the_follow_ups_to_reconcile(settings):
    commit(settings, 100)

    class Killed(BaseException):
        """The agent dies before the server heard of the run."""

    def die(*_args):
        raise Killed

    promote_in_agent(settings, event(100, 0), request_followups=die)
    with pytest.raises(Killed):
        promote_in_agent(settings, event(100, 1), request_followups=die)
    assert audits(settings, 100, "complete") == 1 and audits(settings, 100, "followups-done") == 0

    recorder = Recorder()
    with announcing(recorder):
        reconcile_once(settings, steps=plain_steps())

    assert audits(settings, 100, "followups-done") == 1
    assert recorder.names().count("durable") == 1


def test_a_duplicate_of_a_part_killed_after_the_completion_asks_for_the_checkpoints_run(settings):
    """The completing part's process dies right after it recorded the completion (before it
    asked for the run): the next event of any part of the checkpoint (a duplicate, a retry)
    finds the completion recorded and its follow-ups not done, and asks for the run; once the
    run took them, nothing asks again."""
    commit(settings, 100)

    class Killed(BaseException):
        """The part's process dies right after ``mark_complete`` committed."""

    def die(*_args):
        raise Killed

    promote_in_agent(settings, event(100, 0), request_followups=die)
    with pytest.raises(Killed):
        promote_in_agent(settings, event(100, 1), request_followups=die)
    asked: list[tuple] = []
    promote_in_agent(settings, event(100, 0), request_followups=lambda *a: asked.append(a))
    assert asked == [(RUN, 100, 0, 2, "")]

    recorder = Recorder()
    with announcing(recorder):
        result = promote(settings, *asked[0][:4], steps=plain_steps(), attempt=asked[0][4])  # the asked run
    assert result.durable and recorder.names().count("durable") == 1
    promote_in_agent(settings, event(100, 1), request_followups=lambda *a: asked.append(a))
    assert len(asked) == 1 and audits(settings, 100, "followups-done") == 1


def test_a_malformed_event_is_recorded_and_the_next_one_is_served(settings, caplog):
    commit(settings, 100, parts=1)
    asked: list[tuple] = []
    listener = PartEvents(settings, announcer=Recorder(), fork=False)
    listener.request_followups = lambda *a: asked.append(a)  # type: ignore[method-assign]

    with pytest.raises(BadEvent):
        promote_in_agent(settings, event(100, part=5, parts=2), request_followups=lambda *a: None)
    with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
        bad = listener.submit({"run": "../escape", "step": "x"}).result(timeout=60)
        good = listener.submit(event(100, parts=1)).result(timeout=60)
    listener.stop()

    assert bad is None and good is not None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0] and "malformed checkpoint reference" in errors[0]
    with open_catalog(settings) as cat:
        reasons = [e.reason or "" for e in cat.audit_log(limit=1000) if e.action == "reject"]
    assert len(reasons) == 2 and all("malformed checkpoint reference" in r for r in reasons)
    assert asked == [(RUN, 100, 0, 1, "")]
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}


def test_a_corrupt_part_is_recorded_nothing_reaches_tier1_and_the_next_event_is_served(settings, caplog):
    commit(settings, 100, parts=1)
    commit(settings, 200, parts=1)
    flip_bit(max(ckpt_dir(settings.tier0_url, RUN, 100).glob("*.safetensors")))
    asked: list[tuple] = []
    recorder = Recorder()
    listener = PartEvents(settings, announcer=recorder, fork=False)
    listener.request_followups = lambda *a: asked.append(a)  # type: ignore[method-assign]

    with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
        bad = listener.submit(event(100, parts=1)).result(timeout=60)
        good = listener.submit(event(200, parts=1)).result(timeout=60)
    listener.stop()

    assert bad is None and good is not None
    assert replica_states(settings, RUN, 100) == {(0, 0): "corrupt", (1, 0): "missing"}
    assert not ckpt_dir(settings.tier1_url, RUN, 100).exists()
    assert "corrupt" in recorder.names()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "CorruptCheckpoint" in errors[0] and "\n" not in errors[0]
    assert asked == [(RUN, 200, 0, 1, "")]
    with pytest.raises(CorruptCheckpoint):  # the same event again: still refused, still nothing on Tier 1
        promote_in_agent(settings, event(100, parts=1), request_followups=lambda *a: asked.append(a))
    assert Path(settings.tier1_url, RUN).exists() and not ckpt_dir(settings.tier1_url, RUN, 100).exists()


def test_a_scan_of_an_unmounted_tier0_is_unavailable_and_forgets_nothing(settings):
    """A Tier 0 that is briefly not mounted shows an empty folder: the scan says the tier is
    unavailable, and once the mount is back the parts it knew are not promoted again as parts
    no event brought. A root marked as another tier is no Tier 0 either."""
    from core.errors import TierUnavailable
    from core.storage.identity import MARKER_KEY

    commit(settings, 100, parts=1)
    listener = PartEvents(settings, announcer=Recorder(), fork=False)
    assert listener.scan() == []  # there when the agent started: known
    marker = Path(settings.tier0_url) / MARKER_KEY
    saved = marker.read_bytes()
    marker.unlink()  # the mount gone: its folder holds nothing of the tier
    for _ in range(3):
        with pytest.raises(TierUnavailable):
            listener.scan()
    marker.write_bytes(saved.replace(b'"tier": 0', b'"tier": 1'))  # another tier's root
    with pytest.raises(TierUnavailable):
        listener.scan()
    marker.write_bytes(saved)  # mounted again
    assert listener.scan() == [] and listener.scan() == []
    listener.stop()


def test_a_part_no_event_brought_is_found_on_tier0_and_promoted_once(settings):
    """The event stream is best effort: the agent lists its Tier 0 (``PartEvents.scan``) and
    promotes a part committed without an event, once two scans saw it; what was there when the
    agent started, and what an event brought, is left alone."""
    commit(settings, 100, parts=1)  # there before the agent: reconcile's
    asked: list[tuple] = []
    listener = PartEvents(settings, announcer=Recorder(), fork=False)
    listener.request_followups = lambda *a: asked.append(a)  # type: ignore[method-assign]
    assert listener.scan() == []

    commit(settings, 200, parts=1)  # its event lost
    commit(settings, 300, parts=1)
    listener.submit(event(300, parts=1)).result(timeout=60)  # its event came
    assert listener.scan() == []  # seen once: its event may still be on its way
    assert listener.scan() == [(RUN, 200, 0, "")]
    listener.done[-1].result(timeout=60)
    assert listener.scan() == [] and listener.scan() == []  # once
    listener.stop()

    states = {step: replica_states(settings, RUN, step) for step in (200, 300)}
    assert states[200] == states[300] == {(0, 0): "verified", (1, 0): "verified"}
    assert not ckpt_dir(settings.tier1_url, RUN, 100).exists()
    assert sorted(a[:2] for a in asked) == [(RUN, 200), (RUN, 300)]
