"""The RPO alert: a Prefect automation that raises ``ckpt.checkpoint.late`` for a checkpoint
announced complete on Tier 0 but not durable (every part on Tier 1) within ``rpo_seconds``.

Trigger (proactive, evaluated by the Prefect server every few seconds): after a
``ckpt.checkpoint.completed`` for resource ``ckpt.checkpoint.<run>.<step>``, expect one
``ckpt.checkpoint.durable`` for the same resource within the RPO; ``for_each`` the resource
id, so every checkpoint has its own window. Completed events are per part but share the
checkpoint's resource id, and the durable event is emitted once per checkpoint for that same
id, so a multi-part checkpoint is one window, opened by its first part's event (later parts
do not restart it) and closed by the one durable event.

Action: ``call-webhook`` through a Webhook block (``ckpt-rpo-webhook``) that POSTs to the
Prefect server's own ``/events`` endpoint, with a templated body: the server itself emits
``ckpt.checkpoint.late`` on the checkpoint's resource (run, step, node labels, the automation
as a related resource). Prefect 3.9's automation actions cannot emit an arbitrary event
directly; ``run-deployment`` of a small flow would need an agent to pick the run up, and the
alert must fire precisely when agents are down; ``do-nothing`` would leave only Prefect's
``prefect.automation.triggered`` event, which a consumer of ``ckpt.checkpoint.*`` events
never sees. The webhook keeps everything on the server. (The automation's own
``prefect.automation.triggered`` event also appears in the UI's event feed.)

Idempotent: the block is saved with ``overwrite``, and the automation is looked up by name,
updated when present (duplicates left by a race are deleted) and created otherwise.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from uuid import UUID

from core import events
from tasks import prefect_events

AUTOMATION_NAME = "ckpt-rpo-late"
WEBHOOK_BLOCK = "ckpt-rpo-webhook"

# Rendered by the Prefect server (Jinja): ``event`` is the completed event that opened the
# window, ``firing`` this firing (its id becomes the late event's: a retried action is one event).
# ``tojson`` quotes and escapes the values.
LATE_EVENT_TEMPLATE = """[{
  "id": "{{ firing.id }}",
  "occurred": "{{ firing.triggered.isoformat() }}",
  "event": "%(late)s",
  "resource": {
    "prefect.resource.id": {{ event.resource.id | tojson }},
    "prefect.resource.name": {{ event.resource.name | tojson }},
    "ckpt.run": {{ event.resource['ckpt.run'] | tojson }},
    "ckpt.step": {{ event.resource['ckpt.step'] | tojson }},
    "ckpt.parts": {{ event.resource['ckpt.parts'] | tojson }},
    "ckpt.node": {{ event.resource['ckpt.node'] | tojson }}
  },
  "related": [{"prefect.resource.id": "prefect.automation.{{ automation.id }}",
               "prefect.resource.role": "automation",
               "prefect.resource.name": {{ automation.name | tojson }}}],
  "payload": {"run": {{ event.resource['ckpt.run'] | tojson }},
              "step": {{ event.resource['ckpt.step'] | int }},
              "node": {{ event.resource['ckpt.node'] | tojson }},
              "rpo_seconds": %(rpo)d,
              "completed_event": "{{ event.id }}",
              "completed_at": "{{ event.occurred.isoformat() }}"}
}]"""


def rpo_trigger(rpo_seconds: int) -> Any:
    from prefect.events.schemas.automations import EventTrigger, Posture

    return EventTrigger(
        match={"prefect.resource.id": "ckpt.checkpoint.*"},
        after={events.COMPLETED},
        expect={events.DURABLE},
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=rpo_seconds),
    )


def late_payload(rpo_seconds: int) -> str:
    return LATE_EVENT_TEMPLATE % {"late": events.LATE, "rpo": rpo_seconds}


def rpo_automation(rpo_seconds: int, webhook_block_id: UUID) -> Any:
    from prefect.events.actions import CallWebhook
    from prefect.events.schemas.automations import AutomationCore

    return AutomationCore(
        name=AUTOMATION_NAME,
        description=(f"RPO alert: a checkpoint completed on Tier 0 and not durable on Tier 1 within "
                     f"{rpo_seconds} s (CKPT_RPO_SECONDS) emits {events.LATE}."),
        enabled=True,
        trigger=rpo_trigger(rpo_seconds),
        actions=[CallWebhook(block_document_id=webhook_block_id, payload=late_payload(rpo_seconds))],
    )


def save_webhook(api_url: str) -> UUID:
    """The Webhook block the action calls: POST ``<api_url>/events`` (the server calls itself),
    with the API auth header when auth is on (the block's headers are a secret field, stored
    encrypted by the server)."""
    from prefect.blocks.webhook import Webhook
    from prefect.types import SecretDict
    from pydantic import SecretStr

    block = Webhook(method="POST", url=SecretStr(api_url.rstrip("/") + "/events"),
                    headers=SecretDict({"Content-Type": "application/json", **prefect_events.auth_headers()}))
    block_id = block.save(WEBHOOK_BLOCK, overwrite=True)
    return UUID(str(block_id))


def ensure_rpo_automation(rpo_seconds: int, api_url: str | None = None) -> UUID:
    """Create or update the RPO automation (one per name); returns its id. ``api_url``: the
    Prefect API the server can reach itself at (default: this process's PREFECT_API_URL)."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    url = api_url or PREFECT_API_URL.value()
    if not url:
        raise ValueError("the RPO automation needs a Prefect server (PREFECT_API_URL)")
    automation = rpo_automation(rpo_seconds, save_webhook(url))
    with get_client(sync_client=True) as client:
        existing = sorted(client.read_automations_by_name(AUTOMATION_NAME), key=lambda a: str(a.id))
        if not existing:
            return client.create_automation(automation)
        keep, *extra = existing
        client.update_automation(keep.id, automation)
        for dup in extra:
            client.delete_automation(dup.id)
        return keep.id
