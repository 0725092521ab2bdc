"""copy_to_tier1 / upload_to_tier2: copy one part between tiers under a catalog claim.

The catalog's claim makes the copy happen once however many promotions race: the caller that
acquires it copies; a caller that finds the replica ``verified`` returns a skipped hop; one
that finds another live claim raises ``CopyInProgress`` (transient: a retry finds it done).
``core.transfer.copy_part`` stages, reads back and publishes with the manifest last, so a
replica becomes ``verified`` only after its bytes were read back from the destination. A copy
that fails publishes nothing and leaves the replica ``missing`` (with the reason), which the
next claim may take again; a copy killed outright leaves a claim that expires after the lease.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from core import events
from core.errors import CkptError, CopyInProgress
from core.progress import reporter
from core.settings import Settings
from core.storage.base import checkpoint_prefix
from db.entities import COPYING, CORRUPT, MISSING, VERIFIED
from tasks.base import HopResult, Notify, delete_part, log, no_notify, open_catalog, open_tier, registered_manifest
from tasks.retry import pipeline_task
from tasks.verify import part_replica

DEFAULT_LEASE_S = 120.0  # a killed copy blocks others this long; renewed every fifth of it


def copy_between_tiers(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                       src_tier: int, dst_tier: int, node: str | None = None, actor: str = "cli",
                       lease_seconds: float = DEFAULT_LEASE_S, notify: Notify = no_notify) -> HopResult:
    """Copy a registered part from ``src_tier`` to ``dst_tier`` and record it ``verified``."""
    from core.transfer import copy_part

    node = node or settings.node
    hop = f"tier {src_tier} -> tier {dst_tier}"
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, src_tier) as src, \
            open_tier(settings, dst_tier) as dst:
        ck = cat.get_checkpoint(run, step)
        prefix = checkpoint_prefix(run, step)
        url = dst.url_for(prefix)
        manifest = registered_manifest(cat, src, ck.id, run, step, part, ck.parts)
        prior = part_replica(cat, ck.id, dst_tier, part, None)
        claim = cat.claim_copy(ck.id, dst_tier, part, url, node=None,
                               actor=actor, lease_seconds=lease_seconds)
        if not claim.acquired:
            if claim.replica.state == VERIFIED:
                return HopResult(hop=hop, run=run, step=step, part=part, files=len(manifest.files),
                                 bytes=manifest.total_bytes, seconds=0.0, skipped=True)
            raise CopyInProgress(f"{run}/{step} part {part}: another worker is copying it to "
                                 f"tier {dst_tier} (replica {claim.replica.id}, {claim.replica.state})")
        rep, token = claim.replica, claim.replica.claim_token
        beat = Heartbeat(cat, rep.id, token, every=lease_seconds / 5)
        try:
            if prior is not None and prior.state == CORRUPT:  # known-bad bytes: never resume on them
                delete_part(cat, dst, run, step, part, ck.parts)
            elif prior is not None and prior.state in (COPYING, MISSING) and hasattr(dst, "sweep_staging"):
                # a copy of this part that died: its staging data, untouched for a lease, is
                # garbage; other parts' copies under the same prefix are not ours to touch
                own = [f"{prefix}/{f.path}" for f in manifest.files] + [f"{prefix}/{manifest.name}"]
                dst.sweep_staging(prefix, older_than_s=lease_seconds, keys=own)
            shown = reporter(f"{run}/{step} part {part}: {hop}", manifest.total_bytes)
            report = copy_part(src, prefix, dst, prefix, manifest, parallelism=settings.copy_parallelism,
                               buffer_bytes=settings.io_buffer_bytes,
                               progress=beat if shown is None else _both(beat, shown))
        except BaseException as exc:
            _release(cat, rep.id, token, exc, actor)
            raise
        cat.transition(rep.id, VERIFIED, expected=COPYING, actor=actor, claim_token=token,
                       bytes=report.bytes, copy_seconds=report.seconds,
                       reason=f"copied from tier {src_tier} and read back")
    event = events.PROMOTED if dst_tier == 1 else events.VERIFIED
    notify(event, run, step, part=part, parts=ck.parts, node=node, extra_id=f"tier{dst_tier}",
           payload={"tier": dst_tier, "bytes": report.bytes, "seconds": round(report.seconds, 3),
                    "url": url})
    return HopResult(hop=hop, run=run, step=step, part=part, files=report.files, bytes=report.bytes,
                     seconds=report.seconds, skipped=False)


def copy_to_tier1(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                  node: str | None = None, actor: str = "cli", lease_seconds: float = DEFAULT_LEASE_S,
                  notify: Notify = no_notify) -> HopResult:
    """Tier 0 (this node) -> Tier 1."""
    return copy_between_tiers(settings, run, step, part, parts, src_tier=0, dst_tier=1, node=node,
                              actor=actor, lease_seconds=lease_seconds, notify=notify)


def upload_to_tier2(settings: Settings, run: str, step: int, part: int = 0, parts: int = 1, *,
                    node: str | None = None, actor: str = "cli", lease_seconds: float = DEFAULT_LEASE_S,
                    notify: Notify = no_notify) -> HopResult:
    """Tier 1 -> Tier 2 (milestones; the archive flow decides)."""
    return copy_between_tiers(settings, run, step, part, parts, src_tier=1, dst_tier=2, node=node,
                              actor=actor, lease_seconds=lease_seconds, notify=notify)


class Heartbeat:
    """``progress`` callback for a copy: renews the claim at most every ``every`` seconds.

    Called from the copy's worker threads; a lost claim (``StaleState``) raises inside the
    copy and aborts it, so two workers never publish the same replica.
    """

    def __init__(self, cat: Any, replica_id: int, token: str | None, *, every: float):
        self._cat, self._id, self._token, self._every = cat, replica_id, token, every
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, *_progress: Any, **_kw: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._every:
                return
            self._last = now
        self._cat.heartbeat(self._id, self._token)


def _both(first: Any, second: Any) -> Any:
    def call(done: int) -> None:
        first(done)
        second(done)
    return call


def _release(cat: Any, replica_id: int, token: str | None, exc: BaseException, actor: str) -> None:
    """After a failed copy: ``copying -> missing`` so a retry may claim it at once."""
    try:
        cat.transition(replica_id, MISSING, expected=COPYING, actor=actor, claim_token=token,
                       reason=f"copy failed, nothing published: {type(exc).__name__}: {exc}")
    except CkptError as lost:
        log.warning("replica %s: could not release the claim after a failed copy: %s", replica_id, lost)


copy_to_tier1_task = pipeline_task(copy_to_tier1, name="copy-to-tier1")
upload_to_tier2_task = pipeline_task(upload_to_tier2, name="upload-to-tier2")
