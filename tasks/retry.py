"""The retry policy of every pipeline task: transient errors retry with exponential backoff and
jitter; permanent ones (corrupt data, bad input, a refused prune) fail the task at once.

Results are neither cached nor persisted: a step's truth lives in the catalog and on the
tiers, and a rerun must look again rather than replay an old answer.
"""

from __future__ import annotations

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
