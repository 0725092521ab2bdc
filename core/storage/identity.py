"""A tier root's identity marker: a small object at the root (``MARKER_KEY``) with a random id,
the tier and when it was made. The catalog records the id (``db.tier_roots``); a root proves it
is the tier the catalog knows by showing the same id (``prove``).

Why: a shared file system that is not mounted shows the node's own (empty) mount point, and an
NVMe that is not mounted shows the root disk. Without a proof, writes would land on the wrong
disk and be read back as verified, and copies that are intact on the real tier would be judged
missing. A root that is missing, shows no marker or another one is ``TierUnavailable``:
transient, and never a verdict on any copy.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from core.errors import BadInput, ConflictError, CorruptCheckpoint, NotFound, TierUnavailable
from core.storage.base import TierStore

MARKER_KEY = ".ckpt-tier.json"
MAX_MARKER_BYTES = 4096


@dataclass(frozen=True)
class TierIdentity:
    """What a marker holds."""

    id: str
    tier: int
    created: str

    def to_bytes(self) -> bytes:
        return json.dumps({"id": self.id, "tier": self.tier, "created": self.created}, sort_keys=True).encode()

    @classmethod
    def new(cls, tier: int) -> TierIdentity:
        return cls(id=secrets.token_hex(16), tier=tier, created=datetime.now(UTC).isoformat())

    @classmethod
    def parse(cls, data: bytes) -> TierIdentity:
        """``BadInput`` unless ``data`` is a marker (an object with a string id and an int tier)."""
        try:
            body = json.loads(data)
            ident, tier = body["id"], body["tier"]
        except (ValueError, TypeError, KeyError) as exc:
            raise BadInput(f"not a tier identity marker: {exc}") from None
        if not isinstance(ident, str) or not ident or len(ident) > 64 or type(tier) is not int:
            raise BadInput("not a tier identity marker: bad id or tier")
        return cls(id=ident, tier=tier, created=str(body.get("created", "")))


def read_marker(store: TierStore) -> TierIdentity | None:
    """The marker at ``store``'s root; None when the root holds none. A root that does not
    exist, or a marker that cannot be read as one, is ``TierUnavailable``."""
    if not store.root_exists():
        raise TierUnavailable(store.tier, store.root_url, "its root does not exist (not mounted?)")
    try:
        data = store.read_small(MARKER_KEY, MAX_MARKER_BYTES)
    except NotFound:
        return None
    try:
        return TierIdentity.parse(data)
    except (BadInput, CorruptCheckpoint) as exc:
        raise TierUnavailable(store.tier, store.root_url, f"its identity marker is unreadable ({exc})") from None


def write_marker(store: TierStore) -> TierIdentity:
    """Mark ``store``'s root as a new tier root (the root must exist: it is never created) and
    return the marker now there: another writer's, when one raced this and won."""
    if not store.root_exists():
        raise TierUnavailable(store.tier, store.root_url, "its root does not exist (not mounted?)")
    ident = TierIdentity.new(store.tier)
    try:
        store.write_small_atomic(MARKER_KEY, ident.to_bytes())
    except ConflictError:
        pass  # someone marked it first: theirs is the marker
    found = read_marker(store)
    if found is None:
        raise TierUnavailable(store.tier, store.root_url, "its identity marker vanished as it was written")
    return found


def prove(store: TierStore, recorded: str) -> TierIdentity:
    """The marker at ``store``'s root when it is ``recorded`` (the id the catalog holds);
    ``TierUnavailable`` when the root is missing, shows no marker, or another one."""
    found = read_marker(store)
    if found is None:
        raise TierUnavailable(store.tier, store.root_url,
                              f"its root shows no identity marker ({MARKER_KEY}), so it is not the tier "
                              "recorded in the catalog (a mount that is missing shows an empty folder)")
    if found.id != recorded or found.tier != store.tier:
        raise TierUnavailable(store.tier, store.root_url,
                              f"its root holds another identity marker (tier {found.tier}, id {found.id}; "
                              f"the catalog recorded {recorded})")
    return found
