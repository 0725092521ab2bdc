"""The pipeline's compositions run on either of two sets of steps: the plain functions (tests,
benchmarks, a caller without Prefect) or their Prefect tasks (retries, task runs in the UI).
Both sets take the same arguments, so the composition is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from core.settings import Settings
from tasks.base import HopResult

Step = Callable[..., Any]


@dataclass(frozen=True)
class Steps:
    register: Step
    verify: Step
    mark_complete: Step
    plan_retention: Step
    prune: Step
    tier1_hop: Step  # register, verify on Tier 0, copy to Tier 1, mark complete: one part, one step
    tier2_hop: Step  # upload to Tier 2, verify there: one part, one step


def step_tasks() -> dict[str, Any]:
    """The one registry of pipeline steps: field name of ``Steps`` -> its Prefect task (the
    plain function is the task's ``.fn``). A hop of one part is one task run (``tasks.hop``):
    each task run costs the flow round trips and the server ingest, which a burst of N parts pays
    N times."""
    from tasks.hop import tier1_hop_task, tier2_hop_task
    from tasks.prune import prune_task
    from tasks.record import mark_complete_task
    from tasks.register import register_task
    from tasks.retention import plan_retention_task
    from tasks.verify import verify_task

    return {"register": register_task, "verify": verify_task, "mark_complete": mark_complete_task,
            "plan_retention": plan_retention_task, "prune": prune_task, "tier1_hop": tier1_hop_task,
            "tier2_hop": tier2_hop_task}


def plain_steps() -> Steps:
    """The plain functions: no Prefect, no retries."""
    return Steps(**{name: task.fn for name, task in step_tasks().items()})


def task_steps(settings: Settings | None = None) -> Steps:
    """The Prefect tasks with the configured retry budget (``Settings.task_retries``...)."""
    from tasks.retry import DEFAULT_BASE_DELAY_S, DEFAULT_RETRIES

    r = settings.task_retries if settings is not None else DEFAULT_RETRIES
    d = settings.task_retry_delay_seconds if settings is not None else DEFAULT_BASE_DELAY_S
    return _task_steps(r, d)


@lru_cache(maxsize=8)
def _task_steps(retries: int, base_delay: float) -> Steps:
    """Built once per retry budget and process (``Task.with_options`` costs ~2 ms a task)."""
    from tasks.retry import with_policy

    return Steps(**{name: with_policy(task, retries, base_delay) for name, task in step_tasks().items()})


def hop_rows(hops: list[HopResult]) -> list[dict[str, Any]]:
    return [h.row() for h in hops]


def artifact_key(*words: object) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(w) for w in words).lower()).strip("-")


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


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact in the current flow run; silently nothing outside one. Inside
    ``artifact_batch`` it is posted with the batch, at its end."""
    def post() -> None:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(rows or [{"result": "nothing"}], key=key, description=description)

    publish(key, post)


def publish(key: str, post: Callable[[], Any]) -> None:
    """Run ``post`` (which creates the artifact ``key`` in the current flow run) now, or hand it
    to the open ``artifact_batch``. Best effort: the work an artifact reports is done and recorded
    in the catalog, so an orchestrator that answers 5xx under a burst costs the artifact (a
    warning in the run's log), never the run's result."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    batch = _BATCH.get()
    if batch is not None:
        batch.submit(copy_context().run, _post, key, post)
        return
    _post(key, post)


def _post(key: str, post: Callable[[], Any]) -> None:
    try:
        post()
    except Exception as exc:  # noqa: BLE001 - see publish
        from prefect.logging import get_run_logger

        get_run_logger().warning("artifact %s not published: %s: %s", key, type(exc).__name__, exc)


_BATCH: ContextVar[ThreadPoolExecutor | None] = ContextVar("ckpt_artifact_batch", default=None)


@contextmanager
def artifact_batch(workers: int = 4) -> Iterator[None]:
    """The artifacts published inside are posted on background threads (in the flow run's
    context) while the flow goes on, and waited for on exit: a flow's end waits for at most about
    one API round trip, not one per artifact, and an artifact published before the flow's last
    step (the run's status page, before retention) costs it nothing. Also after an error: what
    was done is shown."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-artifact")
    token = _BATCH.set(pool)
    try:
        yield
    finally:
        _BATCH.reset(token)
        pool.shutdown(wait=True)
