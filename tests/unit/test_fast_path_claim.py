"""The fast path's claim, in order, without a server: a scheduled run is claimed (``Pending``)
and started at once, in the warm process when it is ready, else in a process forked for it (a
burst's second run is neither left ``Scheduled`` for the runner's poll nor queued behind the
next warm-up); a claimed run that no process can start is handed back ``Scheduled``; one the
runner took first is left alone; one cancelled before it starts never starts; the runner's own
promote runs go to the warm process too.

The Prefect client and the warm process are stand-ins that record what the fast path did: the
order of those calls is the behaviour under test (the same path against a real server and real
warm processes: tests/integration/test_fast_path.py).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace

import pytest

from deployments import fast_path
from deployments.fast_path import FastPath, claim_message

NODE = "claim-node"


class Client:
    """Records the calls; grants every proposal unless ``reject`` (the runner was first)."""

    def __init__(self, flow_run, events: list, *, reject: bool = False) -> None:
        self.flow_run, self.events, self.reject = flow_run, events, reject

    async def read_flow_run(self, flow_run_id):
        return self.flow_run

    async def set_flow_run_state(self, flow_run_id, state, force=False):
        from prefect.client.schemas.responses import SetStateStatus

        if self.reject:
            self.events.append(("rejected", state.type.value))
            return SimpleNamespace(status=SetStateStatus.REJECT, state=self.flow_run.state)
        self.events.append(("state", state.type.value, state.message, force))
        self.flow_run = self.flow_run.model_copy(update={"state": state})
        return SimpleNamespace(status=SetStateStatus.ACCEPT, state=state)

    async def update_flow_run(self, flow_run_id, **fields):
        self.events.append(("update", sorted(fields)))


class Warm:
    """A warm process that says ready from its ``ready_after``-th poll on (never: None)."""

    def __init__(self, events: list, ready_after: int | None) -> None:
        self.events, self.ready_after, self.polls = events, ready_after, 0
        self.process = SimpleNamespace(pid=4242, is_alive=lambda: True, terminate=lambda: None)

    def ready(self) -> bool:
        self.polls += 1
        ok = self.ready_after is not None and self.polls > self.ready_after
        if ok:
            self.events.append(("warm ready",))
        return ok

    def run(self, flow_run, stall_s=None) -> None:
        self.events.append(("run", flow_run.state.type.value))

    def stop(self) -> None:
        self.events.append(("warm stopped",))


def _scheduled_run(deployment_id):
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Scheduled

    return FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), deployment_id=deployment_id, name="promote/r/step-1",
                   state=Scheduled())


def _path(warm: Warm, finished: list) -> FastPath:
    path = FastPath(NODE)
    path._spare = warm
    path._refill = lambda: None  # no real process
    path._supervise = lambda *a: None
    path._finish = lambda flow_run_id, why: finished.append(why)
    return path


def test_run_is_claimed_then_started_in_the_ready_warm_process():
    events: list = []
    deployment_id = uuid.uuid4()
    flow_run = _scheduled_run(deployment_id)
    client, warm = Client(flow_run, events), Warm(events, ready_after=0)
    path = _path(warm, [])

    asyncio.run(path._offer(client, flow_run.id, deployment_id))

    assert events == [("state", "PENDING", claim_message(NODE), False), ("warm ready",), ("run", "PENDING"),
                      ("update", ["infrastructure_pid"])]
    assert path._running == {flow_run.id: warm} and not path._claimed


def test_run_that_comes_while_the_warm_process_warms_up_starts_at_once_in_a_process_forked_for_it(monkeypatch):
    """A burst's second run: neither left ``Scheduled`` for the runner's poll nor queued behind
    the next warm-up, it goes to a process of its own, which runs it once warm."""
    events: list = []
    forked: list = []
    deployment_id = uuid.uuid4()
    flow_run = _scheduled_run(deployment_id)
    client, spare = Client(flow_run, events), Warm(events, ready_after=None)  # still warming up
    path = _path(spare, [])
    monkeypatch.setattr(fast_path, "WarmProcess", lambda ctx, env: forked.append(Warm(events, None)) or forked[-1])

    asyncio.run(path._offer(client, flow_run.id, deployment_id))

    assert events == [("state", "PENDING", claim_message(NODE), False), ("run", "PENDING"),
                      ("update", ["infrastructure_pid"])]
    assert len(forked) == 1 and path._running == {flow_run.id: forked[0]}
    assert forked[0].polls == 0  # nothing waited for it to be ready
    assert path._spare is spare and not path._claimed  # the warm process stays for the next run


def test_claimed_run_that_no_process_can_start_is_handed_back_scheduled(monkeypatch):
    events: list = []
    deployment_id = uuid.uuid4()
    flow_run = _scheduled_run(deployment_id)
    client, spare = Client(flow_run, events), Warm(events, ready_after=None)
    path = _path(spare, [])

    def no_fork(ctx, env):
        raise OSError("the fork server is gone")

    monkeypatch.setattr(fast_path, "WarmProcess", no_fork)

    asyncio.run(path._offer_safely(client, flow_run.id, deployment_id))

    assert [e[:2] for e in events] == [("state", "PENDING"), ("state", "SCHEDULED")]
    assert events[-1][3] is True and "the fork server is gone" in events[-1][2]
    scheduled = client.flow_run.state
    assert scheduled.is_scheduled() and scheduled.state_details.scheduled_time is not None  # due: the runner's
    assert not path._running and not path._claimed


def test_run_the_runner_claimed_first_is_left_alone():
    events: list = []
    deployment_id = uuid.uuid4()
    flow_run = _scheduled_run(deployment_id)
    client, warm = Client(flow_run, events, reject=True), Warm(events, ready_after=0)
    path = _path(warm, [])

    asyncio.run(path._offer(client, flow_run.id, deployment_id))

    assert events == [("rejected", "PENDING")]  # nothing started, nothing handed back
    assert warm.polls == 0 and path._spare is warm and not path._claimed


def test_another_nodes_run_is_not_claimed():
    events: list = []
    flow_run = _scheduled_run(uuid.uuid4())
    client, warm = Client(flow_run, events), Warm(events, ready_after=0)
    path = _path(warm, [])

    asyncio.run(path._offer(client, flow_run.id, uuid.uuid4()))

    assert events == []


def test_run_cancelled_between_its_claim_and_its_start_never_starts():
    finished: list = []
    path = _path(Warm([], ready_after=0), finished)
    flow_run_id = uuid.uuid4()
    path._claimed.add(flow_run_id)

    path._cancel(flow_run_id)  # the Cancelling event
    for t in threading.enumerate():  # _finish runs in a thread of its own
        if t.name == f"ckpt-fast-path-{flow_run_id}":
            t.join(5)

    assert finished == ["cancelled before it started"]  # _finish ends it Cancelled (it is Cancelling)
    assert not path._claimed and not path._running  # _offer, resuming, finds its claim gone: no start


@pytest.mark.parametrize("started", [False, True])
def test_stopping_agent_hands_back_what_it_claimed_and_nothing_else(started):
    path = _path(Warm([], ready_after=0), [])
    given: list = []
    path._give_back = given.append
    flow_run_id = uuid.uuid4()
    if started:
        path._running[flow_run_id] = Warm([], ready_after=0)
        path._running[flow_run_id].process = SimpleNamespace(pid=1, terminate=lambda: None, join=lambda t: None)
    else:
        path._claimed.add(flow_run_id)

    path.stop()

    assert given == ([] if started else [flow_run_id])


@pytest.mark.parametrize("case", ["promote, fast path listening", "no fast path", "another flow", "fork fails"])
def test_runner_starts_promote_runs_through_the_fast_path_and_anything_else_as_prefect_does(monkeypatch, case):
    import prefect.flow_engine

    from deployments import names

    started: list = []
    monkeypatch.setattr(prefect.flow_engine, "run_flow_in_subprocess",
                        lambda flow, flow_run=None, **kw: started.append(("prefect", flow.name)) or "spawned")
    path = _path(Warm([], ready_after=0), [])

    def start_now(flow_run):
        if case == "fork fails":
            raise OSError("the fork server is gone")
        started.append(("warm", flow_run.name))
        return SimpleNamespace(pid=4242)

    path.start_now = start_now
    if case != "no fast path":
        monkeypatch.setattr(fast_path, "_active", [path])
    flow = SimpleNamespace(name="reconcile" if case == "another flow" else names.PROMOTE_FLOW)
    flow_run = _scheduled_run(uuid.uuid4())

    result = fast_path.run_in_warm_process(flow, flow_run=flow_run, env={"PREFECT__DEPLOYMENT_NAME": "x"})

    if case == "promote, fast path listening":
        assert started == [("warm", flow_run.name)] and result.pid == 4242
    else:
        assert started == [("prefect", flow.name)] and result == "spawned"


def test_without_a_spare_a_run_gets_a_process_forked_when_it_comes_and_none_is_kept_warm(monkeypatch):
    """``CKPT_WARM_SPARE`` off (the default): nothing is forked ahead of a run, and none after
    it; on: one warm process is kept forked for the next run."""
    events: list = []
    forked: list = []
    monkeypatch.setattr(fast_path, "WarmProcess", lambda ctx, env: forked.append(Warm(events, None)) or forked[-1])
    deployment_id = uuid.uuid4()
    flow_run = _scheduled_run(deployment_id)
    path = FastPath(NODE)
    path._supervise = lambda *a: None

    path._refill()
    assert forked == [] and path._spare is None
    asyncio.run(path._offer(Client(flow_run, events), flow_run.id, deployment_id))

    assert len(forked) == 1 and path._running == {flow_run.id: forked[0]} and path._spare is None
    assert events[-2:] == [("run", "PENDING"), ("update", ["infrastructure_pid"])]

    with_spare = FastPath(NODE, spare=True)
    with_spare._refill()
    assert len(forked) == 2 and with_spare._spare is forked[1]
