"""Settings for tests: ``settings_factory`` (a fixture) and ``catalog_settings``, the one way to
build settings on a real, migrated catalog (SQLite or PostgreSQL), optionally with Tier 2 on
moto's S3 server. ``kit.pipeline.pipeline_settings`` and ``kit.restore.scenario_settings`` are
presets of it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def settings_factory(tmp_path: Path, monkeypatch):
    """Build ``Settings`` rooted in a temp folder (env cleared of CKPT_*)."""
    for k in list(os.environ):
        if k.startswith("CKPT_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)

    def make(**overrides):
        from core.settings import load_settings

        overrides.setdefault("data_dir", tmp_path / "data")
        overrides.setdefault("node", "node-0")
        return load_settings(**overrides)

    return make


def catalog_settings(settings_factory, db_url: str, *, runs: tuple[str, ...] = (), s3_endpoint: str | None = None,
                     s3_bucket: str | None = None, **overrides: Any):
    """Settings on a fresh, migrated catalog at ``db_url`` with ``runs`` registered; Tier 2 on
    the moto server at ``s3_endpoint`` (bucket ``s3_bucket``, prefix ``ckpt``) when given."""
    from db.catalog import Catalog, upgrade

    if s3_endpoint:
        overrides.setdefault("tier2_url", f"s3://{s3_bucket}/ckpt")
        overrides.setdefault("s3_endpoint_url", s3_endpoint)
    settings = settings_factory(catalog_url=db_url, **overrides)
    upgrade(settings.catalog_url)
    set_up_roots(settings)
    if runs:
        with Catalog(settings.catalog_url) as cat:
            for run in runs:
                cat.ensure_run(run, actor="test")
    return settings


def set_up_roots(settings, tiers: tuple[int, ...] = (0, 1, 2)):
    """What an agent start does where the tiers are mounted: each local tier root folder made
    (stores never create one) and every configured root marked and recorded in the catalog."""
    import fsspec

    from tasks.tier_roots import UNAVAILABLE, init_tiers

    for tier in tiers:
        url = settings.tier_url(tier)
        if url and ("://" not in url or url.startswith("file://")):
            Path(url.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        elif url and not url.startswith("s3://"):  # an fsspec file system (memory://): its folder
            fs, root = fsspec.core.url_to_fs(url)
            fs.makedirs(root, exist_ok=True)
    states = init_tiers(settings, actor="test", tiers=tiers)
    assert not [s for s in states if s.state == UNAVAILABLE], [s.line() for s in states]
    return settings


def mark_root(path: Path, tier: int = 0) -> Path:
    """What an agent's start does to a freshly mounted local tier root, short of recording it
    in a catalog: its identity marker written (``core.storage.identity``). A save refuses a
    Tier 0 root that shows none (an NVMe that is not mounted)."""
    from core.storage import identity
    from core.storage.local import LocalStore

    identity.write_marker(LocalStore(path, tier))
    return path
