"""``resume_point``: the one call a training script makes on start, unconditionally.

    point = resume_point("llm-7b", part=node_rank, parts=nodes)
    if point is not None:
        dcp.load(state_dict, checkpoint_id=point.path)

It gives the newest checkpoint of the run with a good copy of every part this node needs, and
a local folder to load it from (this node's Tier 0 copy or the mounted Tier 1 folder in place,
else fetched into Tier 0 or ``to``); ``None`` for a run with no checkpoint yet. The rules are
``tasks.resume``'s; this reads the settings from the environment (or takes them), and sends the
facts the resume announces (a Tier 1 rehydrated, or ``ckpt.resume.rehydrate_failed``) to the
Prefect API the client's events go to.
"""

from __future__ import annotations

from pathlib import Path

from ckpt.announce import to_prefect_api
from core import events
from core.attempt import launch_attempt
from core.settings import Settings, load_settings
from tasks.resume import FETCHED, IN_PLACE, PartResume, ResumePoint, Verify, resume

__all__ = ["FETCHED", "IN_PLACE", "PartResume", "ResumePoint", "resume_point"]


def resume_point(run: str, *, part: int | None = None, parts: int | None = None, to: str | Path | None = None,
                 verify: Verify = "size", settings: Settings | None = None,
                 attempt: str | None = None) -> ResumePoint | None:
    """Where ``run`` resumes on this node (``part`` of ``parts``, or the whole checkpoint):
    ``ResumePoint(run, step, path, parts, note)``, or None when the run has no checkpoint.
    The launch's attempt (``attempt``, else ``core.attempt.launch_attempt``) is recorded as
    resuming from that step: the older attempts' checkpoints above it are superseded, and this
    launch may save those steps again (pass the same ``attempt`` to the stager)."""
    settings = settings or load_settings()
    with events.announcing(to_prefect_api(settings)):
        return resume(settings, run, part=part, parts=parts, to=to, verify=verify, attempt=launch_attempt(attempt))
