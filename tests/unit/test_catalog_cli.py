"""The catalog CLI without a catalog server: an old schema's error names the upgrade command."""

from __future__ import annotations

import os
import sys

import pytest

from ckpt.cli import main


def test_old_schema_error_names_the_upgrade_command(tmp_path, monkeypatch, capsys):
    for key in list(os.environ):
        if key.startswith("CKPT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("CKPT_CATALOG_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    monkeypatch.setattr(sys, "argv", ["ckpt", "ls"])
    with pytest.raises(SystemExit):
        main()
    assert "ckpt db upgrade" in capsys.readouterr().err
