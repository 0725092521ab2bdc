"""The claimed copy: claim -> write or read back -> ``verified`` | released. The one way any
step (promotion, archive, scrub repair, verify) changes a replica's bytes or vouches for them.

``ClaimedCopy.take`` moves the replica to ``copying`` under a fresh claim token (or says why
it could not: already ``verified``, another live claim, a prune owns it). While held, a
background thread renews the lease every fifth of it, so an operation of any length keeps
its claim and a killed worker's claim lapses after one lease (``LEASE_S``, the one lease
policy of the pipeline). Work reports progress through ``held.check`` (or ``held.progress``),
which raises ``StaleState`` once the claim was lost, so two workers never both publish a replica.

A worker alive but stuck (its storage stopped answering: a hung mount, an object store that
never replies) would renew its lease for ever and hold the part from every retry. So renewal
also needs progress: once no byte moved in this process for ``stall_s``
(``Settings.copy_stall_seconds``; every hashing loop and kernel copy beats ``core.progress``)
the thread stops renewing, the claim lapses after its lease, reconcile or a retry takes the part
over, and the stuck worker's next ``check`` raises ``StaleState``: it records nothing, and
commits no part (``transfer.copy_part`` checks once more before the manifest). A
deletion of published files is never cut short (``core.progress.uninterrupted``): a worker taken
over mid-delete that then woke would delete what the new holder had published. The
heartbeat is the process's, not the claim's (a read-back or an fsync reports to no claim): in a
process that copies several parts at once, a hung one is found once the others stop moving.

Leaving the ``with`` block by an exception releases the claim (``copying -> missing`` with the
reason) unless the work already settled the replica (``verified`` or a verdict such as
``corrupt``); so a retry may claim it again at once and nothing claims a copy that failed.

A claim whose answer was lost (the catalog committed it, then the connection dropped, so the
call raised), or whose release could not be recorded (the catalog unreachable as the work
failed), is held by nobody. Its token is kept in this process (``claim_token``), and the
next claim of the same replica here, the step's retry, asks with that token and gets it back
(``Catalog.claim_copy(token=...)``; prunes likewise, ``tasks.prune``, also one whose end could
not be recorded) instead of meeting it as another worker's for a lease (120 s) and then
waiting for reconcile. A token is handed to one
caller at a time, so no two workers ever hold one claim; a killed process's tokens die with it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from core import progress
from core.errors import CkptError, StaleState, is_transient
from db.entities import COPYING, MISSING, VERIFIED, ReplicaInfo
from tasks.base import log

if TYPE_CHECKING:
    from db.catalog import Catalog

LEASE_S = 120.0  # a killed worker blocks the replica this long; renewed every fifth of it

_LOST_KEPT = 1024  # tokens of lost answers kept per process (the oldest go first)
_lost: dict[tuple[object, ...], str] = {}  # what was claimed -> the token of its lost answer
_lost_lock = threading.Lock()


@contextmanager
def claim_token(*what: object) -> Iterator[str]:
    """The token to claim ``what`` with (a replica's copy or prune, on one catalog): the token
    of this process's lost answer for it, if any (taken: one caller at a time), else a fresh
    one; kept for the next caller when the claim raises, since the catalog may have committed
    it (module doc). A ``BaseException`` that is no ``Exception`` (the process going) keeps
    nothing."""
    with _lost_lock:
        token = _lost.pop(what, None) or uuid.uuid4().hex
    try:
        yield token
    except Exception:
        keep_token(what, token)
        raise


def keep_token(what: tuple[object, ...], token: str) -> None:
    """Keep ``token`` for the next claim of ``what`` in this process (``claim_token``): a claim
    held by nobody now, whose answer was lost or whose release could not be recorded."""
    with _lost_lock:
        _lost[what] = token
        while len(_lost) > _LOST_KEPT:
            del _lost[next(iter(_lost))]


def unrecorded(what: tuple[object, ...], token: str | None, exc: BaseException) -> None:
    """A claim's end (released, settled, a prune finished or abandoned) the catalog could not be
    told: on a transient error it stays held there by nobody, so its token is kept
    (``keep_token``) for this process's next claim of ``what``, the step's retry, which takes it
    back instead of waiting out its lease. Any other error (the claim lost) keeps nothing."""
    if token is not None and is_transient(exc):
        keep_token(what, token)


class Lease:
    """A claim's lease kept alive by a background thread (``catalog.heartbeat`` every fifth of
    the lease) for as long as its worker holds it: the one renewal of every claimed operation
    (copy, verify, prune). ``check`` raises ``StaleState`` once the claim was lost."""

    def __init__(self, cat: Catalog, replica_id: int, token: str, lease_s: float, *, stall_s: float | None = None):
        self.cat, self.replica_id, self.token, self.lease_s = cat, replica_id, token, lease_s
        self.stall_s = stall_s  # no byte moved this long: the storage hangs, renewal stops (``stalled``)
        self.beats = 0  # renewals that reached the catalog (tests watch this)
        self._taken = time.monotonic()
        self._lost: StaleState | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, args=(lease_s / 5,), daemon=True,
                                        name=f"lease-replica-{replica_id}")

    def start(self) -> Lease:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def stalled(self, now: float) -> float | None:
        """Seconds since this process last moved a byte (``core.progress``) or the work came back
        to its claim (``check``), since the claim was taken, once past ``stall_s``; else None."""
        if not self.stall_s:
            return None
        idle = now - max(self._taken, progress.last_moved())
        return idle if idle > self.stall_s else None

    def _renew(self, every: float) -> None:
        while not self._stop.wait(every):
            idle = self.stalled(time.monotonic())
            if idle is not None:  # a hung storage: stop renewing, so the claim lapses and the part is tried again
                self._lost = StaleState(f"stalled, no byte moved for {idle:.0f} s (copy_stall_seconds "
                                        f"{self.stall_s:g}): its storage does not answer; the claim is left to "
                                        f"lapse after its lease")
                log.error("replica %s: %s", self.replica_id, self._lost)
                return
            try:
                self.cat.heartbeat(self.replica_id, self.token)
                self.beats += 1
            except StaleState as exc:
                self._lost = exc
                return
            except Exception as exc:  # noqa: BLE001 - a catalog hiccup: the next beat tries again
                log.warning("replica %s: lease renewal failed: %s", self.replica_id, exc)

    def check(self) -> None:
        """Raise ``StaleState`` once the claim was lost; else the work came back to its claim,
        which counts as progress (``core.progress.moved``)."""
        if self._lost is not None:
            raise StaleState(f"replica {self.replica_id}: {self._lost}")
        progress.moved()


def copy_key(cat: Catalog, checkpoint_id: int, tier: int, part: int) -> tuple[object, ...]:
    """What a copy claim claims, for ``claim_token``."""
    return ("copy", cat.url, checkpoint_id, tier, part)


def prune_key(cat: Catalog, replica_id: int) -> tuple[object, ...]:
    """What a prune claim claims, for ``claim_token``."""
    return ("prune", cat.url, replica_id)


class ClaimedCopy:
    """A replica held in ``copying`` under this worker's claim token (see module doc)."""

    def __init__(self, cat: Catalog, replica: ReplicaInfo, *, actor: str, lease_s: float = LEASE_S,
                 what: str = "copy", stall_s: float | None = None):
        assert replica.claim_token is not None
        self.cat, self.replica, self.token = cat, replica, replica.claim_token
        self.actor, self.what, self.lease_s = actor, what, lease_s
        self.settled = False
        self.lease = Lease(cat, replica.id, self.token, lease_s, stall_s=stall_s)
        self.what_key = copy_key(cat, replica.checkpoint_id, replica.tier, replica.part)

    @classmethod
    def take(cls, cat: Catalog, checkpoint_id: int, tier: int, part: int, url: str, *, node: str | None,
             actor: str, lease_s: float = LEASE_S, what: str = "copy",
             stall_s: float | None = None) -> tuple[ClaimedCopy | None, ReplicaInfo]:
        """``(held, replica)``: ``held`` is None when the claim was not acquired, and
        ``replica.state`` says why (``verified``: nothing to do). ``stall_s``: the lease stops
        being renewed once no byte moved for this long (``Lease.stalled``)."""
        with claim_token(*copy_key(cat, checkpoint_id, tier, part)) as token:
            claim = cat.claim_copy(checkpoint_id, tier, part, url, node=node, actor=actor, lease_seconds=lease_s,
                                   token=token)
        if not claim.acquired:
            return None, claim.replica
        return cls(cat, claim.replica, actor=actor, lease_s=lease_s, what=what, stall_s=stall_s), claim.replica

    # --- while held ------------------------------------------------------------------------
    def check(self, *_progress: Any) -> None:
        """Raise ``StaleState`` once the claim was lost (taken over after a stalled lease)."""
        self.lease.check()

    def progress(self, shown: Callable[[int], None] | None = None) -> Callable[[int], None]:
        """A ``progress(done)`` callback for a copy: checks the claim, then feeds ``shown``."""
        def report(done: int) -> None:
            self.check()
            if shown is not None:
                shown(done)
        return report

    # --- settling ------------------------------------------------------------------------
    def verified(self, *, reason: str, bytes: int | None = None, seconds: float | None = None,
                 first_byte_seconds: float | None = None) -> ReplicaInfo:
        """``copying -> verified``: only after the bytes were read back and matched; ``seconds``
        and ``first_byte_seconds`` time the hop that made the copy."""
        self.check()
        rep = self.cat.transition(self.replica.id, VERIFIED, expected=COPYING, actor=self.actor,
                                  claim_token=self.token, bytes=bytes, copy_seconds=seconds,
                                  first_byte_seconds=first_byte_seconds, reason=reason)
        self.settled = True
        return rep

    def settle(self, state: str, reason: str) -> None:
        """Record a verdict other than verified (``corrupt``, ``missing``) under the claim; a
        claim lost meanwhile is logged, not raised (the verdict is raised by the caller). When
        the catalog could not be told (a transient error), the claim stays held there by nobody:
        its token is kept for this process's next claim of the replica (``unrecorded``)."""
        self.settled = True
        try:
            self.cat.transition(self.replica.id, state, expected=COPYING, actor=self.actor,
                                claim_token=self.token, reason=reason[:500])
        except CkptError as lost:
            log.warning("replica %s: could not record %s: %s", self.replica.id, state, lost)
            unrecorded(self.what_key, self.token, lost)

    def __enter__(self) -> Self:
        self.lease.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.lease.stop()
        if exc is not None and not self.settled:
            self.settle(MISSING, f"{self.what} failed, nothing trusted: {type(exc).__name__}: {exc}")
