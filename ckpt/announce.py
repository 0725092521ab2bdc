"""The training side's announcer: registers the run in the catalog and emits
``ckpt.checkpoint.completed`` off the training thread, so a save never waits on Prefect or the
catalog. Events are POSTed to the Prefect API with deterministic ids (a repeat collapses);
what is never delivered, reconcile finds.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core import events
from core.errors import EventTooLarge
from core.manifest import Manifest
from core.settings import Settings
from deployments.names import promote_deployment
from tasks import prefect_events

if TYPE_CHECKING:
    from core.space import Reading

log = logging.getLogger(__name__)

EMIT_RETRIES, EMIT_BACKOFF_SECONDS = 3, 0.5  # a few seconds at most; reconcile covers the rest


@dataclass
class RunRegistration:
    """The run as the catalog should know it, and whether it is recorded yet."""

    run: str
    project: str | None
    origin: tuple[str, int] | None
    relation: str
    attempt: str = ""
    registered: bool = False
    attempt_checked: bool = False
    unreachable_said: bool = False
    refused: str | None = None  # why the catalog refuses every checkpoint of this attempt (a reused name)

    @property
    def done(self) -> bool:
        return self.registered


def register_run(settings: Settings, reg: RunRegistration) -> None:
    """``ensure_run`` with the run's origin, so that the origin is protected from retirement
    before the run's first checkpoint is promoted (an origin the catalog does not know yet is
    recorded pending: ``db.register.ensure_run``). An unreachable catalog leaves it for a later
    try; the manifests carry the origin anyway."""
    from db.catalog import Catalog  # deferred: start-up — SQLAlchemy, Alembic; the client imports this module

    try:
        cat = Catalog(settings.catalog_url)
    except Exception as exc:  # noqa: BLE001 - the catalog may be down; training goes on
        log.warning("catalog not reachable to register run %s: %s", reg.run, exc)
        return
    try:
        cat.ensure_run(reg.run, project=reg.project, parent=reg.origin, parent_relation=reg.relation,
                       actor=f"client:{settings.node}")
        reg.registered = True
    except Exception as exc:  # noqa: BLE001
        log.warning("registering run %s failed: %s", reg.run, exc)
    finally:
        cat.close()


RECENT_PARTS = 8  # how many of the job's last parts its announcer asks the catalog after
ASK_FIRST_S, ASK_MAX_S = 5.0, 60.0  # how often, while one is not known registered: backing off to
ASK_FOR_S = 900.0  # a part not known registered or refused after this long is asked after no more
STOPPING = ("ReusedRunName", "CollidingPaths")  # refusals every later save would meet too


def ask_catalog(settings: Settings, reg: RunRegistration, sent: deque[tuple[Manifest, str, float]],
                first: Manifest | None) -> None:
    """What the training side asks the catalog, off the training thread; what it finds, the
    stager's next save raises (``reg.refused``):

    - once, with the first manifest (``first``): would the catalog refuse every checkpoint of
      this attempt (it never resumed, and the run has a history it did not resume from: a run
      name reused by mistake)? Asked after a save, not at start, so a job that creates its
      stager before it resumes is never refused for that;
    - the job's last parts (``sent``: manifest, digest, when sent): was one refused in a way
      every later save would be too (``STOPPING``: two parts writing one path with other bytes,
      a reused run name)? Another refusal (a copy found corrupt, one step saved again with other
      bytes) is logged, not raised: the next save is a new chance. A part the catalog registered,
      or one sent ``ASK_FOR_S`` ago, leaves ``sent``.

    An unreachable catalog leaves it all for the next try (said once); training goes on."""
    now = time.monotonic()
    for entry in [e for e in sent if now - e[2] > ASK_FOR_S]:
        sent.remove(entry)
    try:
        from db.catalog import Catalog  # deferred: start-up — SQLAlchemy, Alembic

        with Catalog(settings.catalog_url) as cat:
            if first is not None and not reg.attempt_checked:
                reg.refused = reg.refused or cat.attempt_refusal(first.run, first.attempt, created=first.created_at)
                reg.attempt_checked = True
            for entry in list(sent):
                m, digest, _ = entry
                refusal = cat.rejection(m.run, m.step, m.part, digest)
                if refusal is not None:
                    sent.remove(entry)
                    said = f"the catalog refused {m.run} step {m.step} part {m.part}: {refusal.reason}"
                    if refusal.reason.startswith(STOPPING):
                        reg.refused = reg.refused or said
                    else:
                        log.error("%s", said)
                elif cat.part_registered(m.run, m.step, m.part, m.attempt, digest):
                    sent.remove(entry)
    except Exception as exc:  # noqa: BLE001 - the catalog may be down; training goes on
        (log.debug if reg.unreachable_said else log.warning)("catalog not reachable to ask after run %s: %s",
                                                             reg.run, exc)
        reg.unreachable_said = True
        return
    if reg.refused:
        log.error("%s", reg.refused)


class Announcer:
    """Registers the run and emits events off the training thread (importing Prefect and
    reaching the catalog cost seconds the training loop must not wait for). Registration is
    retried before each event until complete; failed events are logged and dropped:
    reconcile finds what was never announced."""

    def __init__(self, settings: Settings, registration: RunRegistration, *, enabled: bool) -> None:
        self.settings = settings
        self.registration = registration
        self.enabled = enabled
        self.delivered: list[tuple[str, int, int, bool]] = []  # (run, step, part, ok), for tests
        self.node_checked = False
        self.sent: deque[tuple[Manifest, str, float]] = deque(maxlen=RECENT_PARTS)  # not yet known registered
        self._ask_every = ASK_FIRST_S
        self._closing = False
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="ckpt-announcer", daemon=True)
        if enabled:
            self._t.start()

    def submit(self, job: tuple[Any, ...]) -> None:
        """``("register",)``, ``("emit", manifest)`` or ``("tier_low", reading, run, step, part, parts, node)``."""
        if self.enabled:
            self._q.put(job)

    def _loop(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=self._ask_every * random.uniform(0.8, 1.2) if self.sent else None)
            except queue.Empty:  # quiet, with parts not known registered yet: ask after them, less often
                ask_catalog(self.settings, self.registration, self.sent, None)
                self._ask_every = min(ASK_MAX_S, self._ask_every * 2)
                continue
            if job is None:
                break
            try:
                if not self.registration.done:
                    register_run(self.settings, self.registration)
                if job[0] == "emit":
                    m = job[1]
                    self._emit(m)  # first: the event is what a job exiting now must not lose
                    self.sent.append((m, m.digest(), time.monotonic()))
                    self._ask_every = ASK_FIRST_S
                    if not self._closing:
                        ask_catalog(self.settings, self.registration, self.sent, m)
                elif job[0] == "tier_low":
                    self._emit_tier_low(*job[1:])
            except EventTooLarge as exc:  # a bug or a hostile payload: said loudly, never sent
                log.error("checkpoint event refused, not sent: %s", exc)
            except Exception as exc:  # noqa: BLE001 - never into training
                log.warning("announcing %s failed: %s", job[0], exc)
            finally:
                self._q.task_done()
        self._q.task_done()

    def _emit(self, m: Manifest) -> None:
        url = prefect_api_url(self.settings)
        ok = emit_completed(m, api_url=url) if url else False
        if url and not self.node_checked:  # after the event: it is the one with a deadline (exit)
            self.node_checked = True
            warn_if_unserved(url, m.node or self.settings.node)
        if not url:
            log.warning("no Prefect API configured: %s step %d not announced", m.run, m.step)
        elif not ok:
            log.warning("%s", undelivered(self.settings, m.run, m.step, m.part, url))
        self.delivered.append((m.run, m.step, m.part, ok))

    def _emit_tier_low(self, reading: Reading, run: str, step: int, part: int, parts: int, node: str) -> None:
        url = prefect_api_url(self.settings)
        if url:
            prefect_events.emit_tier_low(reading, run, step, part=part, parts=parts, node=node, api_url=url,
                                 retries=EMIT_RETRIES, backoff=EMIT_BACKOFF_SECONDS)

    def close(self, timeout: float) -> None:
        if not self.enabled:
            return
        self._closing = True  # what is left to send goes out; nothing more is asked
        self._q.put(("register",))  # a last try at a registration the catalog refused so far
        self._q.put(None)
        self._t.join(timeout)
        if self._t.is_alive():
            log.warning("checkpoint events still pending after %.0fs; reconcile will catch them", timeout)


def node_served(api_url: str, node: str, *, timeout: float = 5.0) -> bool | None:
    """Whether the Prefect API knows a promote deployment for ``node`` (an agent serves it);
    None when the API cannot say (unreachable, another error)."""
    import httpx

    try:
        r = httpx.get(f"{api_url.rstrip('/')}/deployments/name/{promote_deployment(node)}", timeout=timeout,
                      headers=prefect_events.auth_headers())
    except httpx.HTTPError:
        return None
    return True if r.status_code == 200 else False if r.status_code == 404 else None


def warn_if_unserved(api_url: str, node: str) -> None:
    """Say once, loudly, that nothing will promote this node's checkpoints."""
    if node_served(api_url, node) is False:
        log.warning("NO AGENT SERVES NODE %r: checkpoints saved here are committed on Tier 0 but never "
                    "promoted (no deployment %s at %s). Set CKPT_NODE to a node an agent serves (`ckpt up` "
                    "prints each node's) or start `ckpt agent --node %s --node-only` on this machine "
                    "(--node-only: the cluster's agent already serves archive, retention, scrub, drill and "
                    "reconcile's cluster share; "
                    "leave it out only where no agent serves the cluster).", node,
                    _deployment(node), api_url, node)


def _deployment(node: str) -> str:
    return promote_deployment(node)


def completed_payload(m: Manifest) -> dict[str, object]:
    """What the promote trigger templates read (run, step, part, parts, node are added by
    ``prefect_events.emit``) and what the UI's event feed shows."""
    return {"kind": m.kind, "format": m.format, "bytes": m.total_bytes, "files": len(m.files),
            "manifest": m.name, "writer_stall_seconds": m.writer_stall_seconds, "attempt": m.attempt}


def undelivered(settings: Settings, run: str, step: int, part: int, url: str | None) -> str:
    """What a job is told when its checkpoint's event did not arrive: the URL it tried, and that
    nothing is lost (the part stays committed on Tier 0; reconcile finds it)."""
    where = f"to {url}" if url else "(no Prefect API configured: CKPT_PREFECT_API_URL / PREFECT_API_URL)"
    return (f"emit failed: ckpt.checkpoint.completed for {run} step {step} part {part} not delivered {where}; "
            f"the checkpoint stays committed on Tier 0 and the reconcile of node {settings.node} "
            f"promotes it within its interval ({settings.reconcile_interval_seconds} s)")


def prefect_api_url(settings: Settings) -> str | None:
    """Where events go: ``settings.prefect_api_url``, else ``PREFECT_API_URL`` (environment,
    then Prefect's profile). None when nothing is configured: then no event is sent (an
    ephemeral Prefect server in a training process would be no one's server)."""
    url = settings.prefect_api_url or os.environ.get("PREFECT_API_URL")
    if url:
        return url
    try:
        from prefect.settings import PREFECT_API_URL

        return PREFECT_API_URL.value() or None
    except Exception:  # noqa: BLE001
        return None


def emit_completed(m: Manifest, *, api_url: str | None) -> bool:
    """Emit ``ckpt.checkpoint.completed`` for a committed part (deterministic id: the same
    run, step and part give the same id, so a repeat collapses into one event). True when
    the server accepted it."""
    return prefect_events.emit(events.COMPLETED, m.run, m.step, part=m.part, parts=m.parts, node=m.node,
                       payload=completed_payload(m), extra_id=m.attempt, api_url=api_url, retries=EMIT_RETRIES,
                       backoff=EMIT_BACKOFF_SECONDS)


def to_prefect_api(settings: Settings) -> events.Announcer:
    """The announcer of a training-side call that runs pipeline steps itself (``resume``): each
    fact POSTed to ``prefect_api_url`` as the client posts its own events; nothing sent when no
    API is configured (a warning in the log is then the operator's only alert)."""
    url = prefect_api_url(settings)

    def send(name: str, run: str, step: int, **kw: Any) -> bool:
        if not url:
            return False
        return prefect_events.emit(name, run, step, api_url=url, retries=EMIT_RETRIES, backoff=EMIT_BACKOFF_SECONDS,
                                   **kw)

    return send
