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
    if runs:
        with Catalog(settings.catalog_url) as cat:
            for run in runs:
                cat.ensure_run(run, actor="test")
    return settings
