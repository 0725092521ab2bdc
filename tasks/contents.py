"""sweep_shared_contents: delete the shared contents that nothing references any more.

Tier 1 (a file system, ``core.storage.content``): a prune drops the content names its own files
linked; a name a checkpoint file deleted any other way linked (an operator's ``rm -r``, a file
no manifest in the tombstone lists) is dropped here, by a pass over the whole content store
(every name, one stat each), once per scheduled retention run rather than once per prune.

Deleting a checkpoint from Tier 2 deletes its pointers; the shared objects they named stay until
this sweep finds that no replica the catalog holds on Tier 2 (pending, copying, verified, being
pruned, corrupt) references them, in two passes a claim lease apart
(``core.storage.s3.shared.SharedContentMixin.sweep_contents``). Each Tier 2 content deleted is
audited first; Tier 1's names go with their last link already gone (no checkpoint file holds
them) and are audited after, as a count. The scheduled retention run calls it; a content under
Object Lock stays for a later run.
"""

from __future__ import annotations

from core.settings import Settings
from tasks.base import open_catalog, open_tier
from tasks.retry import pipeline_task


def sweep_shared_contents(settings: Settings, *, actor: str = "cli") -> int:
    """Delete the unreferenced shared contents of Tier 1 and Tier 2; how many went. One tier's
    failure never stops the other's sweep: both run, then the first failure is raised."""
    gone, failed = 0, []
    for sweep in (_sweep_tier1, _sweep_tier2):
        try:
            gone += sweep(settings, actor=actor)
        except Exception as exc:  # noqa: BLE001 - raised after the other tier's sweep
            failed.append(exc)
    if failed:
        raise failed[0]
    return gone


def _sweep_tier1(settings: Settings, *, actor: str) -> int:
    """The Tier 1 content names no checkpoint file links any more (link count 1), audited when any went."""
    with open_tier(settings, 1) as store:
        content = getattr(store, "content", None)
        gone = 0 if content is None else int(content.sweep())
    if gone:
        with open_catalog(settings.catalog_url) as cat:
            cat.record_deletion("contents@tier1", f"{gone} shared content(s) no checkpoint file links any more",
                                actor=actor)
    return gone


def _sweep_tier2(settings: Settings, *, actor: str) -> int:
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
