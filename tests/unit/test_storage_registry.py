"""Backends by URL scheme: a backend registered for a scheme of its own is what ``open_store``
opens for it (built from the settings it is given), the settings' Tier 2 check asks it about
its URLs, and a scheme nobody registered is a clear error naming the registered ones."""

from __future__ import annotations

import io

import pytest

from core import checksum
from core.errors import ConfigError
from core.storage import Backend, open_store, register, schemes
from core.storage.local import LocalStore
from core.storage.registry import unregister


@pytest.fixture
def toy(tmp_path):
    """A made-up object-store backend ``toy://NAME``: a local folder per NAME, which takes its
    buffer from the settings and refuses URLs holding ``@``."""
    opened: list[tuple[str, int, object]] = []

    def factory(url, tier, settings):
        opened.append((url, tier, settings))
        buffer = settings.io_buffer_bytes if settings is not None else 4096
        return LocalStore(tmp_path / "toy" / url.removeprefix("toy://"), tier, buffer_bytes=buffer)

    register(Backend(name="toy", schemes=("toy",), factory=factory, object_store=True, example="toy://name",
                     url_problem=lambda url: "tier2_url must not hold credentials (toy://user@name)"
                     if "@" in url else None))
    yield opened
    unregister("toy")


def test_a_registered_scheme_is_opened_by_its_backend(toy, settings_factory):
    settings = settings_factory(io_buffer_bytes=65536)
    assert "toy" in schemes()
    store = open_store("toy://bucket", 2, settings)
    store.root.mkdir(parents=True)  # the bucket is made: a store never creates its root
    assert isinstance(store, LocalStore) and store.tier == 2 and store.buffer_bytes == 65536
    assert toy == [("toy://bucket", 2, settings)]
    data = b"a part"
    store.put_verified("run/step-1/part", io.BytesIO(data), len(data), checksum.hash_bytes(data))
    assert open_store("toy://bucket", 2).read_small("run/step-1/part") == data


def test_the_tier2_check_asks_the_backend_of_the_scheme(toy, settings_factory):
    assert settings_factory(tier2_url="toy://bucket").tier2_url == "toy://bucket"
    with pytest.raises(ConfigError, match=r"must not hold credentials \(toy://user@name\)"):
        settings_factory(tier2_url="toy://me@bucket")
    with pytest.raises(ConfigError, match="must not hold credentials") as err:
        open_store("toy://me@bucket", 2)
    assert "me@bucket" not in str(err.value)  # the URL itself is never echoed


def test_an_unknown_scheme_is_a_clear_error(settings_factory):
    with pytest.raises(ConfigError) as err:
        open_store("nosuch://bucket/prefix", 2, settings_factory())
    message = str(err.value)
    assert "no storage backend for URL scheme 'nosuch'" in message
    assert "file, s3" in message and "fsspec" in message and "\n" not in message
    with pytest.raises(ConfigError, match="tier2_url must look like s3://bucket/prefix: no storage backend"):
        settings_factory(tier2_url="nosuch://bucket/prefix")


def test_a_protocol_registered_with_fsspec_opens_the_fallback():
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from core.storage.fsspec import FsspecStore

    class Scratch(MemoryFileSystem):
        protocol = "ckptscratch"

    fsspec.register_implementation("ckptscratch", Scratch, clobber=True)
    store = open_store("ckptscratch://t1/root", 1)
    assert isinstance(store, FsspecStore)
    store.fs.makedirs(store.root, exist_ok=True)  # a store never creates its root
    data = b"bytes"
    store.put_verified("run/step-1/part", io.BytesIO(data), len(data), checksum.hash_bytes(data))
    assert store.read_small("run/step-1/part") == data
    store.fs.rm(store.root, recursive=True)


def test_tier2_must_be_an_object_store(settings_factory, tmp_path):
    for url in (str(tmp_path / "t2"), f"file://{tmp_path}/t2", "memory://t2"):
        with pytest.raises(ConfigError, match="tier2_url must look like s3://bucket/prefix: Tier 2 is an object "
                                              "store") as err:
            settings_factory(tier2_url=url)
        assert "not one" in str(err.value)
    assert settings_factory(tier2_url="s3://bucket/prefix").tier2_url == "s3://bucket/prefix"
