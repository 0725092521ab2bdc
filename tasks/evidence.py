"""Evidence: is a replica's part really on its tier? The cheap check a prune makes of the copy
that justifies it, in the same prune, before deleting anything (a full re-read is scrub's job).

A part is there when its manifest (the commit marker) is present and is the manifest the
catalog registered, and every registered file is present with its registered size; on object
storage also each file's checksum must be the registered one, as the store proves it
(HeadObject where the endpoint validates checksums; a read-back on an endpoint that only
echoes them). With ``read_back`` every file is read back and checksummed on its tier as well:
what a prune asks by default (``Settings.prune_evidence``), and always when the copy checked
would be the last other verified copy left (``tasks.prune.justification_refused``).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import CorruptCheckpoint, NotFound
from core.layout import checkpoint_prefix, part_key
from core.storage.base import TierStore
from core.tiers import Tier
from db.catalog import Catalog
from db.entities import CORRUPT, MISSING
from tasks.base import registered_manifest


@dataclass(frozen=True)
class Finding:
    """Why a copy is not what the catalog says: ``state`` is ``missing`` or ``corrupt``."""

    state: str
    reason: str


def check_part(cat: Catalog, store: TierStore, checkpoint_id: int, run: str, step: int, part: int,
               parts: int, *, read_back: bool = False, attempt: str = "") -> Finding | None:
    """None when the part's manifest and files on ``store`` match the catalog; else what is
    wrong. With ``read_back`` every file's bytes are read back and checksummed on its tier
    (``verify_object``): a same-size bit flip that scrub has not reached yet is found too.
    Transient storage errors propagate (a copy that could not be checked is no evidence, but
    not a finding either)."""
    try:
        registered_manifest(cat, store, checkpoint_id, run, step, part, parts, attempt=attempt)
    except NotFound:
        return Finding(MISSING, f"manifest {part_key(run, step, part, parts, attempt)} vanished")
    except CorruptCheckpoint as exc:
        return Finding(CORRUPT, f"manifest does not match the catalog: {exc}")
    prefix = checkpoint_prefix(run, step, attempt)
    present = {o.key: o for o in store.list(prefix)}
    for f in cat.files(checkpoint_id, part):
        key = f"{prefix}/{f.path}"
        got = present.get(key)
        if got is None:
            return Finding(MISSING, f"{f.path} vanished")
        if got.size != f.size:
            return Finding(CORRUPT, f"{f.path} has {got.size} bytes, expected {f.size}")
        if read_back or Tier(store.tier).object_store:
            # the stored bytes' checksum as the store proves it: read back on a file system; on
            # object storage HeadObject where the endpoint validates checksums, else a read-back
            try:
                store.verify_object(key, f.size, f.checksum)
            except NotFound:
                return Finding(MISSING, f"{f.path} vanished")
            except CorruptCheckpoint as exc:
                return Finding(CORRUPT, f"{f.path}: {exc}")
    return None
