"""The Prefect sink of checkpoint events: ``emit`` through ``prefect.events`` (or over HTTP to a
given API), and the API auth header that also reads Prefect's profile. ``core.events`` builds the
events and knows nothing of the orchestrator; this is the floor that does.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from core import events
from core.events import (
    AUTH_STRING_ENV,
    TIER_LOW,
    build_event,
    event_id,
    event_payload,
    resource,
    tier_low_payload,
)

log = logging.getLogger("core.events")


def profile_auth_string() -> str | None:
    """``PREFECT_API_AUTH_STRING`` from Prefect's profile; None when unset or Prefect is not installed."""
    try:
        from prefect.settings import get_current_settings

        secret = get_current_settings().api.auth_string
        return secret.get_secret_value() if secret is not None else None
    except Exception:  # noqa: BLE001 - a job without Prefect installed
        return None


def auth_headers(auth_string: str | None = None) -> dict[str, str]:
    """``core.events.auth_headers`` whose default is ``PREFECT_API_AUTH_STRING`` from the
    environment (read now), else Prefect's profile when Prefect is installed."""
    value = auth_string if auth_string is not None else os.environ.get(AUTH_STRING_ENV)
    if value is None:
        value = profile_auth_string()
    return events.auth_headers(value or "")


def emit(name: str, run: str, step: int, *, part: int = 0, parts: int = 1, node: str = "",
         payload: dict[str, Any] | None = None, extra_id: str = "", retries: int = 3,
         backoff: float = 0.5, api_url: str | None = None, labels: dict[str, Any] | None = None,
         resource_id: str = "") -> bool:
    """Emit a Prefect event with a deterministic id. ``labels`` become extra resource labels
    ``ckpt.<key>`` (triggers match labels, never the payload); ``resource_id`` names a resource
    other than the checkpoint (``core.events.tier_resource_id``). Returns False when the event
    could not be delivered (the reconcile flow catches what events miss); raises only
    ``EventTooLarge``, before anything is sent: an event the server would drop is refused loudly.

    With ``api_url`` the event is POSTed to that Prefect API and True means the server
    accepted it (the training client uses this: confirmed, no Prefect import). Without it,
    Prefect's ``emit_event`` queues it to the configured server, linked to the current flow run.
    """
    body = build_event(name, run, step, part=part, parts=parts, node=node, payload=payload, extra_id=extra_id,
                       labels=labels, resource_id=resource_id)
    for attempt in range(retries):
        try:
            if api_url:
                events.post_events(api_url, [body], headers=auth_headers())
                return True
            from prefect.events import emit_event  # here: the training client sends with api_url, no Prefect

            ev = emit_event(
                event=name,
                resource=resource(run, step, part, parts, node, resource_id, **(labels or {})),
                payload=event_payload(run, step, part, parts, node, payload),
                id=event_id(name, run, step, part, extra_id),
            )
            return ev is not None
        except Exception as exc:  # noqa: BLE001 - emission must never break training
            log.warning("emit %s for %s/%s to %s failed (attempt %d of %d): %s", name, run, step,
                        api_url or "the configured Prefect API", attempt + 1, retries, exc)
            if attempt + 1 < retries:
                time.sleep(backoff * (2**attempt))
    return False


def emit_tier_low(reading: Any, run: str, step: int, *, node: str, **kw: Any) -> bool:
    """``ckpt.tier.low`` for the save of ``run``/``step`` that took the tier below the line,
    labelled ``ckpt.tier`` and ``ckpt.node`` (what an automation or the UI's filter matches);
    other keywords as ``emit``."""
    return emit(TIER_LOW, run, step, node=node, payload=tier_low_payload(reading), labels={"tier": reading.tier},
                extra_id=f"tier{reading.tier}", **kw)
