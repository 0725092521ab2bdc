"""The pipeline's compositions run on either of two sets of steps: the plain functions (tests,
benchmarks, a caller without Prefect) or their Prefect tasks (retries, task runs in the UI).
Both sets take the same arguments, so the composition is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.settings import Settings
from tasks.base import HopResult

Step = Callable[..., Any]


@dataclass(frozen=True)
class Steps:
    register: Step
    verify: Step
    copy_to_tier1: Step
    upload_to_tier2: Step
    mark_complete: Step
    plan_retention: Step
    prune: Step


def step_tasks() -> dict[str, Any]:
    """The one registry of pipeline steps: field name of ``Steps`` -> its Prefect task (the
    plain function is the task's ``.fn``)."""
    from tasks.copy import copy_to_tier1_task, upload_to_tier2_task
    from tasks.prune import prune_task
    from tasks.record import mark_complete_task
    from tasks.register import register_task
    from tasks.retention import plan_retention_task
    from tasks.verify import verify_task

    return {"register": register_task, "verify": verify_task, "copy_to_tier1": copy_to_tier1_task,
            "upload_to_tier2": upload_to_tier2_task, "mark_complete": mark_complete_task,
            "plan_retention": plan_retention_task, "prune": prune_task}


def plain_steps() -> Steps:
    """The plain functions: no Prefect, no retries."""
    return Steps(**{name: task.fn for name, task in step_tasks().items()})


def task_steps(settings: Settings | None = None) -> Steps:
    """The Prefect tasks with the configured retry budget (``Settings.task_retries``...)."""
    from tasks.retry import DEFAULT_BASE_DELAY_S, DEFAULT_RETRIES, with_policy

    r = settings.task_retries if settings is not None else DEFAULT_RETRIES
    d = settings.task_retry_delay_seconds if settings is not None else DEFAULT_BASE_DELAY_S
    return Steps(**{name: with_policy(task, r, d) for name, task in step_tasks().items()})


@dataclass
class ArchiveResult:
    run: str
    step: int
    milestone: bool
    hops: list[HopResult] = field(default_factory=list)
    archived: bool = False  # this call saw the checkpoint complete on Tier 2 first
    reason: str = ""

    def summary(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "milestone": self.milestone,
                "archived": self.archived, "reason": self.reason, "hops": hop_rows(self.hops)}


def hop_rows(hops: list[HopResult]) -> list[dict[str, Any]]:
    return [h.row() for h in hops]


def artifact_key(*words: object) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(w) for w in words).lower()).strip("-")


def current_actor(default: str = "cli") -> str:
    """``flow-run:<id>`` inside a flow run (audited in the catalog), else ``default``."""
    try:
        from prefect.runtime import flow_run

        rid = flow_run.get_id()
    except Exception:  # noqa: BLE001 - outside Prefect there is no flow run
        rid = None
    return f"flow-run:{rid}" if rid else default


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact in the current flow run; silently nothing outside one. Best effort: the
    work it reports is done and recorded in the catalog, so an orchestrator that answers 5xx
    under a burst costs the artifact (a warning in the run's log), never the run's result."""
    from prefect.artifacts import create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    try:
        create_table_artifact(rows or [{"result": "nothing"}], key=key, description=description)
    except Exception as exc:  # noqa: BLE001 - see above
        from prefect.logging import get_run_logger

        get_run_logger().warning("artifact %s not published: %s: %s", key, type(exc).__name__, exc)
