"""The pipeline's compositions run on either of two sets of steps: the plain functions (tests,
benchmarks, a caller without Prefect) or their Prefect tasks (retries, task runs in the UI).
Both sets take the same arguments, so the composition is written once. Each member of ``Steps``
has the type of its plain function (a ``Protocol``: the steps take keyword arguments), which
the function and its Prefect task (``Task[P, R]`` calls as ``fn`` does) both satisfy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from functools import lru_cache
from typing import Any, Protocol

from core.settings import Settings
from tasks.base import HopResult
from tasks.hop import Tier1Hop, tier1_hop_task, tier2_hop_task
from tasks.prune import Pruned, prune_task
from tasks.record import mark_complete_task
from tasks.register import Registered, register_stored_part_task
from tasks.retention import PruneAction, plan_retention_task
from tasks.retry import DEFAULT_BASE_DELAY_S, DEFAULT_RETRIES, retrying, with_policy
from tasks.verify import verify_task


class RegisterStep(Protocol):
    """``tasks.register.register_stored_part``: the part's manifest -> the catalog."""

    def __call__(self, settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                 node: str | None = None, actor: str = "cli", source_tier: int = 0,
                 attempt: str = "") -> Registered: ...


class VerifyStep(Protocol):
    """``tasks.verify.verify_replica``: the part's checksums and format on ``tier``, recorded."""

    def __call__(self, settings: Settings, run: str, step: int, part: int = 0, *,
                 tier: int = 0, node: str | None = None, actor: str = "cli",
                 attempt: str | None = None) -> HopResult: ...


class MarkCompleteStep(Protocol):
    """``tasks.record.mark_complete``: true for the one caller that recorded the checkpoint
    complete on ``tier``."""

    def __call__(self, settings: Settings, run: str, step: int, tier: int, *, actor: str = "cli",
                 attempt: str | None = None) -> bool: ...


class PlanRetentionStep(Protocol):
    """``tasks.retention.plan_retention``: what the retention rule demotes or retires."""

    def __call__(self, settings: Settings, *, run: str | None = None, now: datetime | None = None,
                 tiers: Sequence[int] = (0, 1, 2), node: str | None = None,
                 explain: bool = False) -> list[PruneAction]: ...


class PruneStep(Protocol):
    """``tasks.prune.prune_replica``: the guarded delete of one replica."""

    def __call__(self, settings: Settings, replica_id: int, *, actor: str = "cli",
                 reason: str | None = None) -> Pruned: ...


class Tier1HopStep(Protocol):
    """``tasks.hop.tier1_hop``: register, verify on Tier 0, copy to Tier 1, mark complete."""

    def __call__(self, settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                 node: str | None = None, actor: str = "cli", attempt: str = "") -> Tier1Hop: ...


class Tier2HopStep(Protocol):
    """``tasks.hop.tier2_hop``: upload one part to Tier 2, verify it there."""

    def __call__(self, settings: Settings, run: str, step: int, part: int = 0, *, node: str | None = None,
                 actor: str = "cli") -> list[HopResult]: ...


@dataclass(frozen=True)
class Steps:
    register: RegisterStep
    verify: VerifyStep
    mark_complete: MarkCompleteStep
    plan_retention: PlanRetentionStep
    prune: PruneStep
    tier1_hop: Tier1HopStep  # register, verify on Tier 0, copy to Tier 1, mark complete: one part, one step
    tier2_hop: Tier2HopStep  # upload to Tier 2, verify there: one part, one step


def step_tasks() -> dict[str, Any]:
    """The one registry of pipeline steps: field name of ``Steps`` -> its Prefect task (the
    plain function is the task's ``.fn``). A hop of one part is one step (``tasks.hop``), which a
    flow runs in its own body (``task_steps``), not as a task run."""
    registry = Steps(register=register_stored_part_task, verify=verify_task, mark_complete=mark_complete_task,
                     plan_retention=plan_retention_task, prune=prune_task, tier1_hop=tier1_hop_task,
                     tier2_hop=tier2_hop_task)  # mypy checks each task against its member's type
    return {f.name: getattr(registry, f.name) for f in fields(Steps)}


def plain_steps() -> Steps:
    """The plain functions: no Prefect, no retries."""
    return Steps(**{name: task.fn for name, task in step_tasks().items()})


def inline_steps(settings: Settings) -> Steps:
    """Every step inline in the caller, under the configured retry policy (``tasks.retry.retrying``):
    no task run, and no flow run needed around them (reconcile's pass in the agent)."""
    return Steps(**{name: retrying(task.fn, name=task.name, retries=settings.task_retries,
                                   base_delay=settings.task_retry_delay_seconds)
                    for name, task in step_tasks().items()})


PART_HOPS = ("tier1_hop", "tier2_hop")  # the steps that run once per part of a checkpoint


def task_steps(settings: Settings | None = None) -> Steps:
    """The steps a flow runs, with the configured retry budget (``Settings.task_retries``...):
    Prefect tasks, except the hops of a part (``PART_HOPS``), which run in the caller's body under
    the same policy (``tasks.retry.retrying``, each retry a line of the run's log, each hop a row
    of the run's hop table): they run once per part of every checkpoint (the archive's once per
    part of a milestone), and a task run is a run record and three state events more for the
    orchestrator, per part, which a burst of N nodes pays N times."""
    r = settings.task_retries if settings is not None else DEFAULT_RETRIES
    d = settings.task_retry_delay_seconds if settings is not None else DEFAULT_BASE_DELAY_S
    return _task_steps(r, d)


@lru_cache(maxsize=8)
def _task_steps(retries: int, base_delay: float) -> Steps:
    """Built once per retry budget and process (``Task.with_options`` costs ~2 ms a task)."""
    tasks = step_tasks()
    steps = {name: with_policy(task, retries, base_delay) for name, task in tasks.items()}
    steps.update({name: retrying(tasks[name].fn, name=tasks[name].name, retries=retries, base_delay=base_delay)
                  for name in PART_HOPS})
    return Steps(**steps)


def hop_rows(hops: list[HopResult]) -> list[dict[str, Any]]:
    return [h.row() for h in hops]


def current_actor(role: str = "cli") -> str:
    """Who acts, as the catalog's audit records it: ``role`` (``event``: a run an event
    triggered; ``reconcile/<node>``, ``retention``, ...), followed inside a flow run by
    `` flow-run:<id>`` (the run that did it: ``ckpt show --json`` keeps it; tables show the role)."""
    try:
        from prefect.runtime import flow_run

        rid = flow_run.get_id()
    except Exception:  # noqa: BLE001 - outside Prefect there is no flow run
        rid = None
    return f"{role} flow-run:{rid}" if rid else role
