"""The flows' Prefect artifacts: their keys (``artifact_key``), a table (``publish_table``) or
any artifact (``post_artifact``) posted from the current flow run, best effort, and the batch
(``artifact_batch``) that posts a flow's artifacts on background threads while it goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from typing import Any


def artifact_key(*words: object) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(w) for w in words).lower()).strip("-")


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact in the current flow run; silently nothing outside one. Inside
    ``artifact_batch`` it is posted with the batch, at its end."""
    def post() -> None:
        from prefect.artifacts import create_table_artifact

        create_table_artifact([{k: _cell(v) for k, v in r.items()} for r in rows] or [{"result": "nothing"}],
                              key=key, description=description)

    post_artifact(key, post)


def _cell(value: Any) -> Any:
    """A table cell as the UI shows it: a non-finite number as ``nan``/``inf``/``-inf`` (JSON has
    no token for it; Prefect would blank it)."""
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else value


def post_artifact(key: str, post: Callable[[], Any]) -> None:
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


def name_this_run(name: str) -> None:
    """Give the current flow run its name on the open ``artifact_batch``'s threads (else now).
    Prefect's ``flow_run_name`` renames a run with one API round trip before the run is Running;
    named from the body, that round trip overlaps the run's work instead. Best effort, as an
    artifact: a run left with Prefect's generated name loses nothing else."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None or ctx.client is None:
        return
    flow_run_id, client = ctx.flow_run.id, ctx.client
    ctx.flow_run.name = name
    post_artifact(f"name {name}", lambda: client.set_flow_run_name(flow_run_id=flow_run_id, name=name))


def _post(key: str, post: Callable[[], Any]) -> None:
    try:
        post()
    except Exception as exc:  # noqa: BLE001 - see post_artifact
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
