"""Building blocks for the restore, scrub and drill tests: real checkpoints written to Tier 0,
promoted through the real pipeline (plain functions, no Prefect server), a real catalog."""

from __future__ import annotations

import os
from pathlib import Path

from tests.kit.checkpoints import ckpt_dir, commit_manifest
from tests.kit.settings import catalog_settings


def scenario_settings(settings_factory, db_url: str, *, s3_endpoint: str | None = None,
                      s3_bucket: str | None = None, **overrides):
    """Settings rooted in the test's temp folder, catalog at ``db_url`` (migrated), Tier 2 on
    the moto server when given. Retention off unless asked: tests prune by hand."""
    from core.settings import RetentionPolicy

    overrides.setdefault("retention_tier0", RetentionPolicy(enabled=False))
    overrides.setdefault("retention_tier1", RetentionPolicy(enabled=False))
    overrides.setdefault("copy_parallelism", 4)
    return catalog_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket, **overrides)


def tier0_dir(settings, run: str, step: int) -> Path:
    return ckpt_dir(settings.tier0_url, run, step)


def tier1_dir(settings, run: str, step: int) -> Path:
    return ckpt_dir(settings.tier1_url, run, step)


def commit_folder(settings, run: str, step: int, files: dict[str, bytes] | None = None, *,
                  folder: Path | None = None, milestone: bool = False, fmt: str | None = None,
                  part: int = 0, parts: int = 1) -> Path:
    """Commit a checkpoint on Tier 0: ``files`` written there, or ``folder`` moved there; the
    manifest is built from the bytes and written last. Registers the run."""
    from db.catalog import Catalog

    dest = tier0_dir(settings, run, step)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if folder is not None:
        os.rename(folder, dest)
    else:
        for rel, data in (files or {}).items():
            p = dest / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    commit_manifest(dest, run, step, node=settings.node, kind="milestone" if milestone else "step", fmt=fmt,
                    part=part, parts=parts)
    with Catalog(settings.catalog_url) as cat:
        cat.ensure_run(run, actor="test")
    return dest


def promote(settings, run: str, step: int, part: int = 0, parts: int = 1):
    """The real promotion (register, verify, Tier 1, milestone to Tier 2) as plain functions."""
    from flows.common import plain_steps
    from flows.promote import promote as promote_part

    return promote_part(settings, run, step, part, parts, steps=plain_steps(), actor="test")


def on_node(settings, node: str):
    """The same settings as seen from another node (its own Tier 0 folder, set up as the node's
    agent would)."""
    from tests.kit.settings import set_up_roots

    other = settings.model_copy(update={"node": node, "tier0_url": str(Path(settings.data_dir) / "tier0" / node)})
    return set_up_roots(other, tiers=(0,))


def prune(settings, run: str, step: int, tier: int) -> None:
    """Prune a checkpoint from ``tier`` through the guarded prune (as retention would)."""
    from db.catalog import Catalog
    from tasks.prune import prune_replica

    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step)
        ids = [r.id for r in cat.replicas(ck.id, tier) if r.state == "verified"]
    for rid in ids:
        prune_replica(settings, rid, actor="test", reason="test prune")
