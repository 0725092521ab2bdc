"""A tier URL may carry credentials (``sftp://user:password@host/...``, a token in its query):
the store works on the URL as given, and what the catalog records and the CLI and the events
show is the URL without them (``display_url``)."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from core.errors import ConfigError
from core.events import announcing
from core.layout import checkpoint_prefix
from core.settings import display_url, load_settings
from core.storage import open_store
from core.storage.fsspec import FsspecStore
from core.storage.s3 import S3Store
from flows.common import plain_steps
from flows.promote import promote
from tests.kit.catalog import catalog_cli
from tests.kit.checkpoints import write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"
# fixed, unlikely strings: test ids made from them must be the same in every pytest-xdist worker
PASSWORD, TOKEN = "pw-5e3c9d1a7f", "tok-b84f20e6c1"


def test_display_url_keeps_only_scheme_host_port_path_and_harmless_parameters():
    assert display_url(f"sftp://ckpt:{PASSWORD}@nas:22/ckpt") == "sftp://nas:22/ckpt"
    assert display_url(f"s3://AKIA:se/cr@t{PASSWORD}@bucket/x") == "s3://bucket/x"  # "/" and "@" in it
    assert display_url(f"https://{TOKEN}@host/ckpt") == "https://host/ckpt"  # a bare token as userinfo
    assert display_url("sftp://ckpt@nas/ckpt") == "sftp://nas/ckpt"
    assert display_url(f"https://h/ckpt?region=eu&token={TOKEN}&X-Amz-Signature={TOKEN}&sig={TOKEN}") == (
        "https://h/ckpt?region=eu")
    assert display_url(f"https://h/ckpt?pass={TOKEN}&access={TOKEN}&x={TOKEN}") == "https://h/ckpt"
    assert display_url(f"https://h:8443/ckpt#token={TOKEN}") == "https://h:8443/ckpt"
    # a password that holds "/" after digits reads as HOST:PORT to urllib: the host after its "@" tells
    assert display_url("https://user:123/x@host/p") == "https://host/p"
    assert display_url("https://user:123/x@10.0.0.1:9000/p") == "https://10.0.0.1:9000/p"
    assert display_url("s3://AKIA:SE/CRET@bucket/p") == "s3://bucket/p"
    assert display_url(f"s3://AKIA:s@e/cr@t{PASSWORD}@bucket/x") == "s3://bucket/x"  # "@" before the first "/"
    assert display_url(f"https://u:pa#ss{PASSWORD}@host/p") == "https://host/p"  # "#" and "?" in it
    assert display_url(f"https://u:pa?ss{PASSWORD}@host/p") == "https://host/p"
    assert display_url(f"sftp://u:{PASSWORD}@nas:22/ckpt/v@2") == "sftp://nas:22/ckpt/v@2"  # "@" in the path
    assert display_url(f"https://u:{PASSWORD}@h/x?email=a@b.com&region=eu") == "https://h/x?region=eu"
    assert display_url(f"https://u:{PASSWORD}@[::1]:8443/p") == "https://[::1]:8443/p"
    for plain in ("/lustre/ckpt", "file:///lustre/ckpt", "memory://root/v@2", "sftp://nas:22/ckpt/v@2",
                  "https://h/ckpt?region=eu", "file:///home/a@b.com/ckpt", "sftp://[::1]:22/ckpt/v@2"):
        assert display_url(plain) == plain
    store = FsspecStore(f"memory://ckpt:{PASSWORD}@nas/x?token={TOKEN}", 1)
    assert store.url_for("run/step") == "memory://nas/x/run/step"


@pytest.mark.parametrize("url", [f"s3://AKIA:{PASSWORD}@bucket/p", f"s3://{TOKEN}@bucket/p",
                                 f"s3://bucket/p?X-Amz-Credential={TOKEN}", f"s3://bucket/p#{TOKEN}"])
def test_credentials_inside_a_tier2_url_are_refused_saying_where_they_belong(url, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(tier2_url=url, data_dir=tmp_path)
    assert "AWS" in str(err.value) and PASSWORD not in str(err.value) and TOKEN not in str(err.value)
    with pytest.raises(ConfigError) as err:
        S3Store(url, 2, client=object())
    assert PASSWORD not in str(err.value) and TOKEN not in str(err.value)


def test_tier1_credentials_are_used_but_never_recorded_or_shown(settings_factory, db_url, monkeypatch, tmp_path):
    root = f"nas/{uuid.uuid4().hex[:8]}"
    url = f"memory://ckpt:{PASSWORD}@{root}/tier1"  # memory://: the password is part of the path
    settings = pipeline_settings(settings_factory, db_url, tier1_url=url)
    m = write_checkpoint(settings.tier0_url, RUN, 100)
    seen = []
    try:
        with announcing(lambda *args, **kw: seen.append((args, kw)) or True):
            promote(settings, RUN, 100, steps=plain_steps())
        with open_store(url, 1) as store:  # the copy is where the real URL points
            assert {o.key for o in store.list(checkpoint_prefix(RUN, 100))} >= {
                f"{checkpoint_prefix(RUN, 100)}/{f.path}" for f in m.files}
    finally:
        fsspec.filesystem("memory").rm(f"/ckpt:{PASSWORD}@{root}", recursive=True)

    cli = catalog_cli(monkeypatch, tmp_path, settings.catalog_url)
    located = json.loads(cli("locate", RUN, "100", "--json"))
    (tier1,) = [r["url"] for r in located if r["tier"] == 1]
    assert tier1 == f"memory://{root}/tier1/{checkpoint_prefix(RUN, 100)}"
    shown = cli("show", RUN, "100", "--json") + json.dumps(located) + repr(seen)
    assert PASSWORD not in shown
