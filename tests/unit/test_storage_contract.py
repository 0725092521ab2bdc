"""Storage rules that need no backend server: symlinks out of the root, run names, the S3 part-size rule."""

from __future__ import annotations

import os

import pytest

from core.errors import PathEscape
from core.storage.local import LocalStore
from tests.kit.stores import all_names, put, read

MiB = 1024 * 1024


def test_symlink_out_of_local_root_rejected(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    store = LocalStore(tmp_path / "tier", tier=1)
    (tmp_path / "tier").mkdir()
    os.symlink(outside, tmp_path / "tier" / "run")
    with pytest.raises(PathEscape):
        read(store, "run/secret")
    with pytest.raises(PathEscape):
        put(store, "run/new", b"x")
    assert not (outside / "new").exists()
    assert all_names(store) == []  # listing does not follow the link out


def test_s3_part_size_stays_within_the_part_limit():
    from core.storage.s3 import MAX_PARTS, part_size

    assert part_size(100 * MiB, 8 * MiB) == 8 * MiB
    for size in (10**12, 5 * 10**12, MAX_PARTS * 8 * MiB + 1):
        p = part_size(size, 8 * MiB)
        assert -(-size // p) <= MAX_PARTS and p % MiB == 0


def test_deleting_a_symlinked_file_removes_the_link_not_its_target(tmp_path):
    """A checkpoint file that is a link to another checkpoint's file: pruning the first must
    leave the second intact (another checkpoint's copy, possibly its last)."""
    (tmp_path / "tier").mkdir()  # a store never creates its root
    store = LocalStore(tmp_path / "tier", tier=0)
    put(store, "r/step-00000001/w.bin", b"the only copy")
    (tmp_path / "tier" / "r" / "step-00000002").mkdir()
    os.symlink("../step-00000001/w.bin", tmp_path / "tier" / "r" / "step-00000002" / "w.bin")

    assert store.delete_prefix("r/step-00000002/w.bin") == 1

    assert not os.path.lexists(tmp_path / "tier" / "r" / "step-00000002" / "w.bin")
    assert read(store, "r/step-00000001/w.bin") == b"the only copy"


@pytest.mark.parametrize("name", ["abc\n", "abc\r", "../x", "a/b", ".hidden", ""])
def test_run_names_that_are_not_one_clean_path_segment_are_rejected(name):
    from core.paths import safe_run_name

    with pytest.raises(PathEscape):
        safe_run_name(name)


def test_s3_server_clock_is_the_responses_date_and_this_machines_clock_without_one():
    from datetime import UTC, datetime

    from core.storage.s3 import server_clock

    said = {"ResponseMetadata": {"HTTPHeaders": {"date": "Wed, 10 Nov 2010 20:48:43 GMT"}}}
    assert server_clock(said) == datetime(2010, 11, 10, 20, 48, 43, tzinfo=UTC)
    for silent in ({}, {"ResponseMetadata": {"HTTPHeaders": {"date": "not a date"}}}):
        assert abs((server_clock(silent) - datetime.now(UTC)).total_seconds()) < 60


def test_a_folder_tier_moves_what_a_claim_deletes_into_its_tombstone(tmp_path):
    """On a folder tier ``bury`` moves a part's folder into a hidden tombstone named for the claim
    (one rename), so the names are free for a new holder at once; ``exhume`` puts back only what
    nobody took since; ``sweep_tombs`` removes the tombstones of claims that are over."""
    (tmp_path / "tier").mkdir()  # a store never creates its root
    store = LocalStore(tmp_path / "tier", tier=1)
    for k in ("r/step-00000001/manifest.json", "r/step-00000001/w.bin", "r/step-00000002/w.bin"):
        put(store, k, k.encode())

    tomb = store.bury("r/step-00000001", None, token="aaa1")
    assert all_names(store) == ["r/step-00000002/w.bin"]  # set aside: never listed
    assert (tmp_path / "tier" / "r" / ".ckpt-tomb-aaa1-step-00000001" / "w.bin").is_file()
    assert store.exhume(tomb) == 1 and all_names(store) == [
        "r/step-00000001/manifest.json", "r/step-00000001/w.bin", "r/step-00000002/w.bin"]

    tomb = store.bury("r/step-00000001", ["manifest.json", "w.bin"], token="bbb2")
    put(store, "r/step-00000001/w.bin", b"the next holder's")  # published meanwhile: not put back over
    assert store.exhume(tomb) == 1
    assert read(store, "r/step-00000001/w.bin") == b"the next holder's"
    assert read(store, "r/step-00000001/manifest.json") == b"r/step-00000001/manifest.json"

    store.bury("r/step-00000002", None, token="ccc3")  # its worker never deletes it
    assert store.sweep_tombs("r", lambda tokens: {"ccc3"} & set(tokens)) == 1  # bbb2's is over
    assert sorted(p.name for p in (tmp_path / "tier" / "r").iterdir()) == [".ckpt-tomb-ccc3-step-00000002",
                                                                            "step-00000001"]
    assert store.sweep_tombs("r", lambda tokens: set()) == 1
    assert all_names(store) == ["r/step-00000001/manifest.json", "r/step-00000001/w.bin"]


def test_a_store_never_creates_its_root(tmp_path):
    """A tier root that is not there (a mount missing) stays absent: writes are unavailable."""
    from core.errors import StorageUnavailable
    from core.storage.fsspec import FsspecStore

    local = LocalStore(tmp_path / "lustre" / "ckpt", 1)
    memory = FsspecStore(f"memory://absent-{os.getpid()}/ckpt", 1)
    for store in (local, memory):
        assert not store.root_exists()
        with pytest.raises(StorageUnavailable, match="does not exist"):
            store.write_small_atomic("run/step-1/manifest.json", b"{}")
        assert not store.root_exists()
    assert not (tmp_path / "lustre").exists()


def test_only_a_folder_here_is_read_in_place(tmp_path):
    """The one question a resume asks a store: a local folder answers with the part's folder
    (and takes staged writes there); a store read through its API answers None (fetch first)."""
    from core.storage import open_store

    (tmp_path / "tier").mkdir()
    with open_store(f"file://{tmp_path}/tier", 1, None) as folder:
        assert folder.in_place("r/step-00000001") == (tmp_path / "tier" / "r" / "step-00000001").resolve()
        assert folder.in_place() == tmp_path / "tier"
        assert folder.write_path("r/step-00000001") == (tmp_path / "tier" / "r" / "step-00000001").resolve()
    with open_store("memory://tier", 1, None) as api:
        assert api.in_place("r/step-00000001") is None and api.in_place() is None
