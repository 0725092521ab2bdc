"""A flow's artifacts are posted on background threads while it goes on, concurrently, and
waited for at its end: the end of a promotion waits for at most about one orchestrator round
trip, not one per artifact; one refused artifact costs only itself."""

from __future__ import annotations

import threading
from contextvars import ContextVar

import pytest

from flows import artifacts

WHO: ContextVar[str] = ContextVar("who", default="nobody")


@pytest.fixture
def in_flow_run(monkeypatch):
    """A flow run context as far as ``post_artifact`` asks, and a run logger that records warnings."""
    import prefect.context
    import prefect.logging

    warnings: list[str] = []

    class Logger:
        def warning(self, msg, *args):
            warnings.append(msg % args)

    monkeypatch.setattr(prefect.context.FlowRunContext, "get", classmethod(lambda cls: object()))
    monkeypatch.setattr(prefect.logging, "get_run_logger", Logger)
    return warnings


def test_artifacts_in_a_batch_are_posted_concurrently_in_the_callers_context_by_its_end(in_flow_run):
    posted: list[tuple[str, str]] = []
    # three posts that can only all finish if they run at the same time
    together = threading.Barrier(3, timeout=30)

    def post(key: str):
        def run() -> None:
            together.wait()
            posted.append((key, WHO.get()))
        return run

    WHO.set("flow-run-7")
    with artifacts.artifact_batch():
        for key in ("promote-a", "retention-a", "run-a"):
            artifacts.post_artifact(key, post(key))  # returns at once: the flow goes on
    assert sorted(posted) == [("promote-a", "flow-run-7"), ("retention-a", "flow-run-7"), ("run-a", "flow-run-7")]
    assert in_flow_run == []


def test_a_refused_artifact_is_a_warning_and_the_others_are_still_posted(in_flow_run):
    posted: list[str] = []

    def refused() -> None:
        raise RuntimeError("500 Internal Server Error")

    with artifacts.artifact_batch():
        artifacts.post_artifact("bad", refused)
        artifacts.post_artifact("good", lambda: posted.append("good"))
    assert posted == ["good"]
    assert in_flow_run == ["artifact bad not published: RuntimeError: 500 Internal Server Error"]


def test_artifacts_are_posted_even_when_the_flow_body_fails(in_flow_run):
    posted: list[str] = []
    with pytest.raises(ValueError), artifacts.artifact_batch():
        artifacts.post_artifact("promote-a", lambda: posted.append("promote-a"))
        raise ValueError("the copy failed")
    assert posted == ["promote-a"]


def test_outside_a_batch_an_artifact_is_posted_at_once_and_outside_a_flow_run_not_at_all(monkeypatch, in_flow_run):
    posted: list[str] = []
    artifacts.post_artifact("now", lambda: posted.append("now"))
    assert posted == ["now"]
    import prefect.context

    monkeypatch.setattr(prefect.context.FlowRunContext, "get", classmethod(lambda cls: None))
    artifacts.post_artifact("never", lambda: posted.append("never"))
    assert posted == ["now"]
