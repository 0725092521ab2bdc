"""sweep_shared_contents: delete the Tier 2 contents that no replica references any more.

Deleting a checkpoint from Tier 2 deletes its pointers; the shared objects they named stay until
this sweep finds that no replica the catalog holds on Tier 2 (pending, copying, verified, being
pruned, corrupt) references them, in two passes a claim lease apart
(``core.storage.s3.shared.SharedContentMixin.sweep_contents``). Each content deleted is audited
first, as every delete is. The scheduled retention run calls it; a content under Object Lock
stays for a later run.
"""

from __future__ import annotations

from core.settings import Settings
from tasks.base import open_catalog, open_tier
from tasks.retry import pipeline_task


def sweep_shared_contents(settings: Settings, *, actor: str = "cli") -> int:
    """Delete the unreferenced shared contents of Tier 2; how many went (0 without Tier 2)."""
    if not settings.tier2_url:
        return 0
    with open_catalog(settings.catalog_url) as cat, open_tier(settings, 2) as store:
        sweep = getattr(store, "sweep_contents", None)
        if sweep is None:
            return 0

        def audited(key: str, size: int) -> None:
            cat.record_deletion(f"content:{key}@tier2", f"a shared content of {size} bytes that no replica "
                                "references any more", actor=actor)

        return int(sweep(lambda: cat.referenced_contents(2), grace_s=settings.claim_lease_seconds,
                         deleted=audited))


sweep_shared_contents_task = pipeline_task(sweep_shared_contents, name="sweep-shared-contents")
