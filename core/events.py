"""Checkpoint events: names, deterministic ids, the event body and its HTTP delivery; the emit
through Prefect (which never breaks the caller) is ``tasks.prefect_events``.

Event ids are UUIDv5 of (name, run, step, part, extra) so that the same fact announced twice
(a retried emit, a duplicate watcher) collapses into one event in Prefect, and one triggered
run. Resource id: ``ckpt.checkpoint.<run>.<step>``; labels carry run, step, part, parts and
node so deployment triggers can match on them (each node's agent matches its own node label).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC
from typing import Any

from core.errors import EventTooLarge

COMPLETED = "ckpt.checkpoint.completed"  # training side: a part is committed on Tier 0
VERIFIED = "ckpt.checkpoint.verified"
PROMOTED = "ckpt.checkpoint.promoted"  # a part verified on Tier 1
DURABLE = "ckpt.checkpoint.durable"  # every part verified on Tier 1 (once per checkpoint; again only by
# whoever finishes follow-ups a killed promotion left before recording them done)
ARCHIVED = "ckpt.checkpoint.archived"  # verified on Tier 2
PRUNED = "ckpt.checkpoint.pruned"
CORRUPT = "ckpt.checkpoint.corrupt"
REJECTED = "ckpt.checkpoint.rejected"
RESTORED = "ckpt.checkpoint.restored"
LATE = "ckpt.checkpoint.late"  # completed, not durable within the RPO (emitted by the RPO automation)
REHYDRATE_FAILED = "ckpt.resume.rehydrate_failed"  # a resume could not rehydrate Tier 1 (full,
# unreachable) and fetched into the node's own folder instead: the operator's alert
TIER_LOW = "ckpt.tier.low"  # a tier's free space fell below a few checkpoints' worth (once per crossing)
TIER_UNAVAILABLE = "ckpt.tier.unavailable"  # a tier root failed its identity proof (tasks.tier_roots)
TIER_OVER_BUDGET = "ckpt.tier.over_budget"  # what a tier's rules keep exceeds its max_bytes (tasks.retention)

# Prefect's server drops an event over PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES (1.5 MB by
# default) after answering 204, so an event that big must never leave: ``build_event`` refuses
# it. The headroom covers what the server adds (received time, follows, its own encoding).
MAX_EVENT_BYTES = 1_500_000
EVENT_HEADROOM_BYTES = 16 * 1024

_NS = uuid.UUID("6f1c5d2e-7a43-4b8e-9a51-2f0d3c9e8b10")


def event_id(name: str, run: str, step: int, part: int = 0, extra: str = "") -> uuid.UUID:
    """Deterministic id: same (name, run, step, part, extra) -> same id."""
    return uuid.uuid5(_NS, f"{name}|{run}|{step}|{part}|{extra}")


def tier_resource_id(tier: int, node: str = "") -> str:
    """The resource of a tier root's events (``ckpt.tier.<tier>``, ``.<node>`` for Tier 0)."""
    return f"ckpt.tier.{tier}" + (f".{node}" if node else "")


def resource(run: str, step: int, part: int = 0, parts: int = 1, node: str = "", resource_id: str = "",
             **labels: Any) -> dict[str, str]:
    """The event's resource: the checkpoint's, or ``resource_id`` for a fact about something
    else (a tier root: ``tier_resource_id``)."""
    res = {
        "prefect.resource.id": resource_id or f"ckpt.checkpoint.{run}.{step}",
        "prefect.resource.name": resource_id or f"{run}/step-{step}",
        "ckpt.run": run,
        "ckpt.step": str(step),
        "ckpt.part": str(part),
        "ckpt.parts": str(parts),
        "ckpt.node": node,
    }
    res.update({f"ckpt.{k}": str(v) for k, v in labels.items()})
    return res


def event_payload(run: str, step: int, part: int, parts: int, node: str,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The payload every checkpoint event carries (trigger templates read these keys)."""
    body: dict[str, Any] = {"run": run, "step": step, "part": part, "parts": parts, "node": node}
    body.update(extra or {})
    return body


def build_event(name: str, run: str, step: int, *, part: int = 0, parts: int = 1, node: str = "",
                payload: dict[str, Any] | None = None, extra_id: str = "",
                labels: dict[str, Any] | None = None, resource_id: str = "") -> dict[str, Any]:
    """The event as JSON, exactly what ``POST {PREFECT_API_URL}/events`` takes (a list of these):
    a job without Prefect installed can announce a checkpoint with one HTTP call. Raises
    ``EventTooLarge`` for an event the server would silently drop (``check_size``)."""
    from datetime import datetime

    return check_size({
        "id": str(event_id(name, run, step, part, extra_id)),
        "occurred": datetime.now(UTC).isoformat(),
        "event": name,
        "resource": resource(run, step, part, parts, node, resource_id, **(labels or {})),
        "related": [],
        "payload": event_payload(run, step, part, parts, node, payload),
    })


def check_size(event: dict[str, Any], max_bytes: int = MAX_EVENT_BYTES) -> dict[str, Any]:
    """``event`` unchanged when its JSON, plus headroom for what the server adds, fits under
    ``max_bytes``; ``EventTooLarge`` naming the size and the limit otherwise."""
    import json

    size = len(json.dumps(event, default=str).encode())
    if size + EVENT_HEADROOM_BYTES > max_bytes:
        raise EventTooLarge(f"event {event.get('event')} for {event.get('resource', {}).get('prefect.resource.name')} "
                            f"is {size} bytes; the orchestrator drops events over {max_bytes} bytes "
                            f"(PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES) less {EVENT_HEADROOM_BYTES} of headroom: "
                            "keep payloads to counts and names, never file lists")
    return event


AUTH_STRING_ENV = "PREFECT_API_AUTH_STRING"


def auth_headers(auth_string: str | None = None) -> dict[str, str]:
    """The header a Prefect server started with ``PREFECT_SERVER_API_AUTH_STRING`` wants on every
    API call but ``GET /health`` and ``GET /ready``: HTTP Basic whose credentials are the base64 of
    the auth string itself (no ``user:`` part), as Prefect's own clients send it. ``auth_string``
    defaults to ``PREFECT_API_AUTH_STRING`` (the environment, read now); ``{}`` when none is set (a
    server without auth). ``tasks.prefect_events.auth_headers`` also reads Prefect's profile."""
    import base64
    import os

    value = auth_string if auth_string is not None else os.environ.get(AUTH_STRING_ENV)
    if not value:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(value.encode()).decode()}


def post_events(api_url: str, batch: list[dict[str, Any]], *, timeout: float = 5.0,
                headers: dict[str, str] | None = None) -> None:
    """Deliver events over Prefect's HTTP events endpoint; raises unless the server took them
    (204). Unlike the websocket worker behind ``emit_event``, the caller knows it arrived. Sends
    ``headers``, by default ``auth_headers()``: a server with API auth on answers 401 without them."""
    import httpx

    # plain http has no certificate to check: no CA bundle parsed per call (CPU each time);
    # no redirect is followed, so nothing reaches https unverified
    r = httpx.post(api_url.rstrip("/") + "/events", json=batch, timeout=timeout,
                   headers=auth_headers() if headers is None else headers,
                   verify=not api_url.lower().startswith("http://"))
    if r.status_code != 204:
        raise ConnectionError(f"Prefect events endpoint answered {r.status_code}: {r.text[:200]}")


def tier_low_payload(reading: Any) -> dict[str, Any]:
    """What ``ckpt.tier.low`` carries beside run/step/node: the tier and the numbers
    (``reading`` is a ``core.space.Reading``)."""
    return {"tier": reading.tier, "free_bytes": max(reading.free_after, 0),
            "checkpoint_bytes": reading.checkpoint_bytes,
            "headroom_checkpoints": round(max(reading.headroom, 0.0), 2), "threshold": reading.threshold}


# --- announcing from pipeline steps --------------------------------------------------------
Announcer = Callable[..., Any]
_announcer: ContextVar[Announcer | None] = ContextVar("ckpt_announcer", default=None)


def announce(name: str, run: str, step: int, **kw: Any) -> bool:
    """Announce a fact from a pipeline step through the announcer in force (``announcing``);
    nothing outside one. Steps never take a callable for this: the flow that runs them says
    how facts are announced (``emit`` inside a Prefect run), a test records them."""
    fn = _announcer.get()
    return bool(fn(name, run, step, **kw)) if fn is not None else False


@contextmanager
def announcing(fn: Announcer) -> Iterator[Announcer]:
    """Route ``announce`` to ``fn`` (same signature as ``emit``) inside the block."""
    token = _announcer.set(fn)
    try:
        yield fn
    finally:
        _announcer.reset(token)
