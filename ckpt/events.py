"""Checkpoint events: names, deterministic ids, and emission that never breaks the caller.

Event ids are UUIDv5 of (name, run, step, part, extra) so that the same fact announced twice
(a retried emit, a duplicate watcher) collapses into one event in Prefect, and one triggered
run. Resource id: ``ckpt.checkpoint.<run>.<step>``; labels carry run, step, part, parts and
node so deployment triggers can match on them (each node's agent matches its own node label).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

log = logging.getLogger(__name__)

COMPLETED = "ckpt.checkpoint.completed"  # training side: a part is committed on Tier 0
VERIFIED = "ckpt.checkpoint.verified"
PROMOTED = "ckpt.checkpoint.promoted"  # a part verified on Tier 1
DURABLE = "ckpt.checkpoint.durable"  # every part verified on Tier 1 (once per checkpoint)
ARCHIVED = "ckpt.checkpoint.archived"  # verified on Tier 2
PRUNED = "ckpt.checkpoint.pruned"
CORRUPT = "ckpt.checkpoint.corrupt"
REJECTED = "ckpt.checkpoint.rejected"
RESTORED = "ckpt.checkpoint.restored"

_NS = uuid.UUID("6f1c5d2e-7a43-4b8e-9a51-2f0d3c9e8b10")


def event_id(name: str, run: str, step: int, part: int = 0, extra: str = "") -> uuid.UUID:
    """Deterministic id: same (name, run, step, part, extra) -> same id."""
    return uuid.uuid5(_NS, f"{name}|{run}|{step}|{part}|{extra}")


def resource(run: str, step: int, part: int = 0, parts: int = 1, node: str = "", **labels: Any) -> dict[str, str]:
    res = {
        "prefect.resource.id": f"ckpt.checkpoint.{run}.{step}",
        "prefect.resource.name": f"{run}/step-{step}",
        "ckpt.run": run,
        "ckpt.step": str(step),
        "ckpt.part": str(part),
        "ckpt.parts": str(parts),
        "ckpt.node": node,
    }
    res.update({f"ckpt.{k}": str(v) for k, v in labels.items()})
    return res


def emit(name: str, run: str, step: int, *, part: int = 0, parts: int = 1, node: str = "",
         payload: dict[str, Any] | None = None, extra_id: str = "", retries: int = 3,
         backoff: float = 0.5) -> bool:
    """Emit a Prefect event with a deterministic id. Never raises: returns False when the
    event could not be delivered (the reconcile flow catches what events miss)."""
    from prefect.events import emit_event

    body = {"run": run, "step": step, "part": part, "parts": parts, "node": node}
    body.update(payload or {})
    for attempt in range(retries):
        try:
            ev = emit_event(
                event=name,
                resource=resource(run, step, part, parts, node),
                payload=body,
                id=event_id(name, run, step, part, extra_id),
            )
            return ev is not None
        except Exception as exc:  # noqa: BLE001 - emission must never break training
            log.warning("emit %s for %s/%s failed (attempt %d): %s", name, run, step, attempt + 1, exc)
            time.sleep(backoff * (2**attempt))
    return False
