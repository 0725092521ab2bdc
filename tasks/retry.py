"""The retry policy of every pipeline step: transient errors retry with exponential backoff and
jitter; permanent ones (corrupt data, bad input, a refused prune) fail the step at once.

A step runs under it either as a Prefect task (``pipeline_task``: Prefect retries the task run)
or inline in the caller's run (``retrying``: the same policy in a plain loop, each retry logged
to the run): the steps that run once per part of a checkpoint, its hops to Tier 1 and Tier 2,
run inline, so that a checkpoint of N parts does not cost the orchestrator N task runs.

Results are neither cached nor persisted: a step's truth lives in the catalog and on the
tiers, and a rerun must look again rather than replay an old answer.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from core.errors import is_transient

if TYPE_CHECKING:
    from prefect import Task

DEFAULT_RETRIES = 4
DEFAULT_BASE_DELAY_S = 2.0
JITTER_FACTOR = 0.5

P = ParamSpec("P")
R = TypeVar("R")


def backoff_delays(retries: int, base_delay: float) -> list[float]:
    """``base, 2*base, 4*base, ...``: one delay per retry (Prefect adds the jitter)."""
    return [base_delay * 2**i for i in range(retries)]


def jittered(delay: float, factor: float = JITTER_FACTOR, draw: Callable[[], float] = random.random) -> float:
    """``delay`` spread uniformly over ``[delay * (1 - factor), delay * (1 + factor)]`` (workers
    that failed together do not retry together)."""
    return max(0.0, delay * (1 + factor * (2 * draw() - 1)))


def run_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The current Prefect run's logger (its lines reach the run's log in the UI), else
    ``ckpt.retry`` outside a run."""
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:  # noqa: BLE001 - MissingContextError outside a run, or no Prefect at all
        return logging.getLogger("ckpt.retry")


def _sleep(seconds: float) -> None:
    """The wait before an inline retry (a module attribute: a test watches or skips the waits)."""
    time.sleep(seconds)


def retrying(fn: Callable[P, R], *, name: str, retries: int = DEFAULT_RETRIES,
             base_delay: float = DEFAULT_BASE_DELAY_S, draw: Callable[[], float] = random.random) -> Callable[P, R]:
    """``fn`` under the task policy, run inline in the caller's run: a transient error (``is_transient``)
    is retried up to ``retries`` times after ``backoff_delays`` with jitter, each retry a warning in
    the run's log (``name: error; retry i of n in s``); a permanent error, or the last transient
    one, is raised at once. The step must be idempotent (each pipeline step is: module doc)."""
    delays = backoff_delays(retries, base_delay)

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if attempt == retries or not is_transient(exc):
                    raise
                wait = jittered(delays[attempt], draw=draw)
                first_line = (str(exc).splitlines() or [""])[0]
                run_logger().warning("%s: %s: %s; retry %d of %d in %.1f s", name, type(exc).__name__, first_line,
                                     attempt + 1, retries, wait)
                _sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    return call


def retry_if_transient(_task: Any, _task_run: Any, state: Any) -> bool:
    """``retry_condition_fn``: retry only when the failure's exception is transient."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - classify whatever the step raised
        return is_transient(exc)
    return False


def pipeline_task(fn: Callable[P, R], *, name: str, retries: int = DEFAULT_RETRIES,
                  base_delay: float = DEFAULT_BASE_DELAY_S) -> Task[P, R]:
    """A thin Prefect task over the plain step ``fn`` with the project's retry policy."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    return task(
        name=name,
        retries=retries,
        retry_delay_seconds=backoff_delays(retries, base_delay),
        retry_jitter_factor=JITTER_FACTOR,
        retry_condition_fn=retry_if_transient,
        cache_policy=NO_CACHE,
        persist_result=False,
    )(fn)


def with_policy(task_: Any, retries: int, base_delay: float) -> Any:
    """The same task with another retry budget (flows apply the configured one)."""
    return task_.with_options(retries=retries, retry_delay_seconds=backoff_delays(retries, base_delay))
