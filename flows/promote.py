"""promote_checkpoint: make one checkpoint part durable, then (once per checkpoint) archive
and prune.

register (Tier 0 manifest -> catalog) -> verify Tier 0 (recorded as a verified replica on
this node) -> copy to Tier 1 (claimed, read back, published manifest last), as one step
(``tasks.hop``, under the task retry policy, no task run of its own) -> when the catalog reports every part verified on
Tier 1 (``complete_on_tier``), the caller that takes the checkpoint's follow-ups (any caller
that finds them not recorded done and not under a live lease: a retry, a duplicate event or
reconcile finishes what a killed one left): archive a milestone to Tier 2, announce
``ckpt.checkpoint.durable`` (after the archive: it asks for the archive deployment, a safety
net, only when the inline archive did not finish), the status page, the run's retention.
A part already verified on Tier 1 (a repeated or concurrent event) skips the copy, so any
number of promotions of the same part leave one set of copies and the same catalog state. A
corrupt source stops at verify: nothing is copied, nothing else changes.

A part has no run: the node's agent runs its hop on the event (``promote_in_agent``) and the
part that completes the checkpoint asks for one run of this flow, which finds its part on Tier 1,
takes the follow-ups and shows every part's hop in its hop table (``tasks.hop.tier1_hop_rows``):
one run per checkpoint (a flow run costs the orchestrator more than a part's hop costs the node).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prefect import flow

from core import events
from core.errors import BadEvent
from core.events import announcing
from core.settings import Settings, load_settings
from flows.archive import ArchiveResult, archive
from flows.artifacts import artifact_batch, artifact_key, name_this_run, publish_table
from flows.common import Steps, current_actor, hop_rows, task_steps
from flows.retention import run_retention
from flows.status import publish_run_status
from tasks.base import HopResult, log
from tasks.hop import tier1_hop_rows
from tasks.prefect_events import emit
from tasks.record import claim_followups, followups_done, followups_open
from tasks.register import attempt_arg, checkpoint_args, reject_event
from tasks.retention import PruneAction


@dataclass
class PromoteResult:
    run: str
    step: int
    part: int
    parts: int
    checkpoint_id: int
    hops: list[HopResult] = field(default_factory=list)
    durable: bool = False  # this promotion ran the checkpoint's follow-ups (completed it, or finished them)
    archive: ArchiveResult | None = None
    retention: list[PruneAction] | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.run, "step": self.step, "part": self.part, "parts": self.parts,
            "checkpoint_id": self.checkpoint_id, "durable": self.durable,
            "hops": hop_rows(self.hops),
            "archive": self.archive.summary() if self.archive else None,
            "retention": [a.row() for a in self.retention] if self.retention is not None else None,
        }


def promote(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *, steps: Steps,
            node: str | None = None, actor: str = "cli",
            on_durable: Callable[[PromoteResult], None] | None = None, attempt: str = "") -> PromoteResult:
    """The promotion of one part, composed from ``steps`` (plain functions or Prefect tasks).
    Once the checkpoint is complete on Tier 1, the caller that takes its follow-ups
    (``claim_followups``: whoever finds them not done and not held, not only the one that
    completed it) runs them (``follow_up``)."""
    node = node or settings.node
    hop = steps.tier1_hop(settings, run, step, part, parts, node=node, actor=actor, attempt=attempt)
    result = PromoteResult(run, step, part, hop.parts, hop.checkpoint_id, hops=hop.hops)
    if claim_followups(settings, hop.checkpoint_id):
        follow_up(settings, result, steps=steps, node=node, actor=actor, on_durable=on_durable)
    return result


def follow_up(settings: Settings, result: PromoteResult, *, steps: Steps, node: str, actor: str,
              on_durable: Callable[[PromoteResult], None] | None = None) -> None:
    """What follows a checkpoint becoming durable, by the caller holding its follow-ups: archive
    a milestone, announce ``ckpt.checkpoint.durable``, ``on_durable(result)`` (the status page),
    retention; then recorded done. Each piece is idempotent, so a caller killed half-way leaves
    them to the next one (a retry, a duplicate event, reconcile) once its lease lapses."""
    run, step = result.run, result.step
    result.durable = True
    try:
        result.archive = archive(settings, run, step, steps=steps, actor=actor)
    finally:  # announced after the inline archive, so the archive it triggers finds it done
        wants = archive_wanted(settings, result.archive)
        events.announce(events.DURABLE, run, step, parts=result.parts, node=node,
                        payload={"tier": 1, "milestone": wants}, labels={"milestone": str(wants).lower()})
    if on_durable is not None:
        on_durable(result)
    result.retention = run_retention(settings, run=run, steps=steps, actor=actor)
    followups_done(settings, result.checkpoint_id, actor=actor)


FollowupsRequest = Callable[[str, int, int, int, str], None]


def promote_in_agent(settings: Settings, payload: Mapping[str, Any], *,
                     request_followups: FollowupsRequest) -> PromoteResult:
    """The promotion of one part with no flow run of its own: what a node's agent runs for each
    completed event of its node (deployments/part_events.py), ``payload`` the event's. The part's
    hop (``tasks.hop``: register, copy to Tier 1 checking Tier 0 on the way, read back, mark
    complete) runs under the task retry policy (``tasks.retry.retrying``) at the copy priority,
    its facts announced through the caller's announcer (the agent's: ``emit``), as in a promote
    run. The one caller per
    checkpoint that records it complete on Tier 1 (``Tier1Hop.durable``) then asks for the
    checkpoint's one promote run (``request_followups(run, step, part, parts)``), which finds this
    part on Tier 1 and takes the follow-ups (``follow_up``) as any promote run does. Not only the
    caller that recorded the completion asks: any part's promotion that finds the follow-ups open
    (``followups_open``: not done, not held) asks again, so a part killed between the completion
    and its request is finished by the next event of the checkpoint (a duplicate, a retry), not
    only by reconcile's backlog; every request is the same run (``followups_key``). A malformed
    event is audited as a rejection in the catalog and raised (``BadEvent``)."""
    actor = f"event agent:{settings.node} pid:{os.getpid()}"  # the role, then the process that did it
    try:
        run, step, part, parts = checkpoint_args(payload.get("run"), payload.get("step"), payload.get("part", 0),
                                                 payload.get("parts") or 1)
        attempt = attempt_arg(payload.get("attempt"))
    except BadEvent as exc:
        reject_event(settings, f"promote {payload.get('run')!r} step {payload.get('step')!r}", exc, actor=actor)
        # no flow run shows it: the event feed does (the Prefect UI's Events page)
        events.announce(events.REJECTED, str(payload.get("run"))[:200], 0, node=settings.node,
                        payload={"reason": f"{type(exc).__name__}: {exc}"[:1000], "malformed_event": True})
        raise
    # the hop as a flow runs it, inline: the registry's step and retry policy
    hop = task_steps(settings).tier1_hop(settings, run, step, part, parts, node=settings.node, actor=actor,
                                         attempt=attempt)
    if followups_open(settings, hop.checkpoint_id):
        request_followups(run, step, part, hop.parts, attempt)
    return PromoteResult(run, step, part, hop.parts, hop.checkpoint_id, hops=hop.hops)


def followups_key(run: str, step: int, attempt: str = "") -> str:
    """The idempotency key of a checkpoint's promote run asked for by ``promote_in_agent``: the
    server creates one run per key and deployment, so a request repeated is the same run (and
    another attempt's checkpoint at the same step is another run)."""
    return f"ckpt-followups/{run}/{step}" + (f"@{attempt}" if attempt else "")


def crash_followups_run(run: str, step: int, attempt: str, why: str) -> None:
    """The checkpoint's promote run (``followups_key``), left ``Pending`` or ``Running`` by a
    process that ended before it did, recorded ``Crashed`` with ``why``. Nothing when it already
    ended, when no Prefect API is configured, or when it cannot be read (logged)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterIdempotencyKey
    from prefect.settings import get_current_settings
    from prefect.states import Crashed

    if not get_current_settings().api.url:
        return
    try:
        with get_client(sync_client=True) as client:
            key = FlowRunFilterIdempotencyKey(any_=[followups_key(run, step, attempt)])
            for flow_run in client.read_flow_runs(flow_run_filter=FlowRunFilter(idempotency_key=key)):
                if flow_run.state is not None and not flow_run.state.is_final():
                    client.set_flow_run_state(flow_run.id, Crashed(message=why), force=True)
                    log.warning("promote run %s of %s step %s crashed: %s", flow_run.id, run, step, why)
    except Exception as exc:  # noqa: BLE001 - the checkpoint's follow-ups are finished all the same
        log.warning("could not record the end of the promote run of %s step %s: %s: %s", run, step,
                    type(exc).__name__, exc)


def archive_wanted(settings: Settings, done: ArchiveResult | None) -> bool:
    """Whether the durable event should start the archive deployment (its trigger matches the
    ``ckpt.milestone`` label): only as the safety net for an inline archive that never finished
    (``done`` is None: it raised) while Tier 2 is configured. ``archive`` returns only once every
    part of a milestone is verified on Tier 2 (``done.archived``, or another caller completed
    Tier 2 first) or once it found nothing to archive (not a milestone, Tier 2 not configured),
    so after any returned result an archive run would find nothing left to do."""
    return done is None and bool(settings.tier2_url)


def run_name(params: dict[str, Any]) -> str:
    """``promote/<run>/step-<step>[/part-i-of-n]``; a malformed event's run reads
    ``promote/malformed-event/run=...,step=...`` instead of ``promote//step-``."""
    try:
        run, step, part, parts = checkpoint_args(params.get("run"), params.get("step"), params.get("part", 0),
                                                 params.get("parts") or 1)
    except BadEvent:
        raw = f"run={params.get('run')!r},step={params.get('step')!r}"
        return f"promote/malformed-event/{raw[:80]}"
    name = f"promote/{run}/step-{step}"
    return name if parts == 1 else f"{name}/part-{part}-of-{parts}"


@flow(name="promote-checkpoint")  # named from its body (name_this_run), not with flow_run_name
def promote_checkpoint(run: str, step: int | str, part: int | str = 0, parts: int | str = 1,
                       node: str | None = None, attempt: str = "") -> dict:
    """Settings read once here; the steps run as Prefect tasks (the part's hop in this run's body:
    ``task_steps``); a table artifact per promotion (by the promotion that made the checkpoint
    durable: every part's hop, ``tier1_hop_rows``, and the archive's), and the run's status page
    (``run-<name>``, flows/status.py) republished; all posted on background threads while the
    promotion goes on, waited for at the end (``artifact_batch``), as is the run's name
    (``run_name``: ``promote/<run>/step-<step>``, set from here so that Prefect's rename is not
    one more round trip before the run starts).
    Parameters may arrive as strings (event trigger templates); a malformed one fails the run
    with a rejection audited in the catalog."""
    with artifact_batch():
        name_this_run(run_name({"run": run, "step": step, "part": part, "parts": parts}))
        return _promote_checkpoint(run, step, part, parts, node, attempt)


def _promote_checkpoint(run: str, step: int | str, part: int | str, parts: int | str, node: str | None,
                        attempt: str = "") -> dict:
    settings = load_settings(**({"node": node} if node else {}))
    actor = current_actor("event")
    try:
        run, step, part, parts = checkpoint_args(run, step, part, parts)
        attempt = attempt_arg(attempt)
    except BadEvent as exc:
        reject_event(settings, f"promote {run!r} step {step!r}", exc, actor=actor)
        raise
    with announcing(emit):
        def show(result: PromoteResult) -> None:
            hops = result.hops + (result.archive.hops if result.archive else [])
            publish_table(artifact_key("promote", run, step, part), hop_rows(hops),
                          f"promotion of {run} step {step} part {part + 1}/{result.parts}")

        def durable(result: PromoteResult) -> None:
            # posted while retention runs (which keeps the newest checkpoints the page shows); the
            # run's status page (key run-<name>) changes when a checkpoint does, not with each part
            parts = tier1_hop_rows(settings, run, step, result.checkpoint_id)
            archived = hop_rows(result.archive.hops) if result.archive else []
            publish_table(artifact_key("promote", run, step, part), parts + archived,
                          f"promotion of {run} step {step}: its {result.parts} part(s)")
            publish_run_status(settings, run, durable_steps=(result.step,))

        result = promote(settings, run, step, part, parts, steps=task_steps(settings), node=settings.node,
                         actor=actor, on_durable=durable, attempt=attempt)
        if not result.durable:
            show(result)
    return result.summary()
