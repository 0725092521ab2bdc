"""Building blocks for the restore, scrub and drill tests: real checkpoints written to Tier 0,
promoted through the real pipeline (plain functions, no Prefect server), a real catalog.

Imported by tests as ``restore_scenario`` (``tests/`` is on sys.path through its conftest).
"""

from __future__ import annotations

import os
from pathlib import Path

from core.manifest_build import build_manifest, write_manifest
from core.layout import checkpoint_prefix


def scenario_settings(settings_factory, db_url: str, *, s3_endpoint: str | None = None,
                      s3_bucket: str | None = None, **overrides):
    """Settings rooted in the test's temp folder, catalog at ``db_url`` (migrated), Tier 2 on
    the moto server when given. Retention off unless asked: tests prune by hand."""
    from db.catalog import upgrade
    from core.settings import RetentionPolicy

    if s3_endpoint:
        overrides.setdefault("tier2_url", f"s3://{s3_bucket}/ckpt")
        overrides.setdefault("s3_endpoint_url", s3_endpoint)
    overrides.setdefault("retention_tier0", RetentionPolicy(enabled=False))
    overrides.setdefault("retention_tier1", RetentionPolicy(enabled=False))
    overrides.setdefault("copy_parallelism", 4)
    settings = settings_factory(catalog_url=db_url, **overrides)
    upgrade(settings.catalog_url)
    return settings


def tier0_dir(settings, run: str, step: int) -> Path:
    return Path(settings.tier0_url) / checkpoint_prefix(run, step)


def tier1_dir(settings, run: str, step: int) -> Path:
    return Path(settings.tier1_url) / checkpoint_prefix(run, step)


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
    manifest = build_manifest(dest, run, step, node=settings.node, kind="milestone" if milestone else "step",
                              fmt=fmt, part=part, parts=parts)
    write_manifest(dest, manifest)
    with Catalog(settings.catalog_url) as cat:
        cat.ensure_run(run, actor="test")
    return dest


def promote(settings, run: str, step: int, part: int = 0, parts: int = 1):
    """The real promotion (register, verify, Tier 1, milestone to Tier 2) as plain functions."""
    from flows.common import plain_steps
    from flows.promote import promote as promote_part

    return promote_part(settings, run, step, part, parts, steps=plain_steps(), actor="test")


def on_node(settings, node: str):
    """The same settings as seen from another node (its own Tier 0 folder)."""
    return settings.model_copy(update={"node": node, "tier0_url": str(Path(settings.data_dir) / "tier0" / node)})


def prune(settings, run: str, step: int, tier: int) -> None:
    """Prune a checkpoint from ``tier`` through the guarded prune (as retention would)."""
    from db.catalog import Catalog
    from tasks.prune import prune_replica

    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step)
        ids = [r.id for r in cat.replicas(ck.id, tier) if r.state == "verified"]
    for rid in ids:
        prune_replica(settings, rid, actor="test", reason="test prune")


def replica_states(settings, run: str, step: int) -> dict[int, str]:
    """{tier: state} of part 0's replicas."""
    from db.catalog import Catalog

    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step)
        return {r.tier: r.state for r in cat.replicas(ck.id) if r.part == 0}


def flip_byte(path: Path, offset: int = -1) -> None:
    """Flip one bit of a stored file in place (silent corruption)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def s3_client(settings):
    import boto3

    return boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name="us-east-1")


def s3_key(settings, run: str, step: int, rel: str) -> tuple[str, str]:
    """(bucket, key) of a checkpoint file on Tier 2."""
    bucket, _, prefix = settings.tier2_url[len("s3://"):].partition("/")
    return bucket, f"{prefix}/{checkpoint_prefix(run, step)}/{rel}"


def corrupt_s3_object(settings, run: str, step: int, rel: str) -> None:
    """Replace a Tier 2 object with the same size but one bit flipped (no checksum sent, as a
    faulty or foreign writer would)."""
    client = s3_client(settings)
    bucket, key = s3_key(settings, run, step, rel)
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
