"""A prune on a Tier 1 that shares content (``core.storage.content``), with ``--contents`` other
contents in its content store, each linked by another checkpoint's file (``--contents`` of them
on a real cluster: every shard of every checkpoint kept).

Each round deletes one checkpoint of ``--files`` files (a single-part folder: its manifest and
files, each a content of its own) as retention does (``TierStore.bury``, then ``delete_tomb``):
now, which drops the contents that checkpoint's files linked and reads no other; and as before
this change, the tombstone removed and then the whole content store swept (one stat per stored
content). Both contenders delete the same kind of checkpoint from the same store in the same
rounds, order rotated; after each, the checkpoint's contents are gone and the others stay.

    .venv/bin/python benchmarks/prune_contents.py [--contents 10000] [--files 8] [--rounds 7] [--dir PATH]
    .venv/bin/python benchmarks/prune_contents.py --smoke
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_parser, load_line, parse, run_rounds, table
from core.checksum import hash_bytes
from core.layout import SINGLE_MANIFEST, checkpoint_prefix
from core.manifest import FileEntry, Manifest
from core.storage.local import LocalStore

BASE = "before: then a sweep of every content"
NOW = "now: the tombstone's own contents"
SMOKE = {"contents": 200, "files": 2}
FILE_BYTES = 4096


def fill(store: LocalStore, count: int) -> None:
    """``count`` contents, each linked by one file of another checkpoint (as the store leaves them)."""
    assert store.content is not None
    for i in range(count):
        data = i.to_bytes(8, "little") * (FILE_BYTES // 8)
        name = store.content.entry(len(data), hash_bytes(data))
        name.parent.mkdir(parents=True, exist_ok=True)
        name.write_bytes(data)
        linked = store.root / "other" / f"step-{i // 1000:08d}" / f"shard-{i % 1000:04d}.bin"
        linked.parent.mkdir(parents=True, exist_ok=True)
        os.link(name, linked)


def save(store: LocalStore, step: int, files: int) -> str:
    """A committed single-part checkpoint of ``files`` files, each a new content; its prefix."""
    prefix = checkpoint_prefix("run", step)
    entries = []
    for i in range(files):
        data = os.urandom(FILE_BYTES)
        store.put_verified(f"{prefix}/f{i}.bin", io.BytesIO(data), len(data), hash_bytes(data))
        entries.append(FileEntry(f"f{i}.bin", len(data), hash_bytes(data)))
    store.write_small_atomic(f"{prefix}/{SINGLE_MANIFEST}", Manifest("run", step, tuple(entries)).to_json())
    return prefix


def stored(store: LocalStore) -> int:
    assert store.content is not None
    return sum(len(files) for _, _, files in os.walk(store.content.folder))


def main() -> None:
    ap = bench_parser(__doc__, rounds=7)
    ap.add_argument("--contents", type=int, default=10_000, help="other contents in the content store")
    ap.add_argument("--files", type=int, default=8, help="files (contents) of the checkpoint pruned")
    ap.add_argument("--dir", default=None, help="folder on the file system to measure (default: system temp)")
    args = parse(ap, SMOKE)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-prune-", dir=args.dir) as d:
        store = LocalStore(d, 1, shared_content=True)
        assert store.content is not None
        content = store.content
        fill(store, args.contents)
        step = 0
        pending: dict[str, str] = {}

        def prepare(_name: str) -> None:  # untimed: the checkpoint the next contender prunes
            nonlocal step
            assert stored(store) == args.contents  # the last prune's contents went, the others stayed
            step += 1
            pending["prefix"] = save(store, step, args.files)
            assert stored(store) == args.contents + args.files

        def now() -> None:
            store.delete_tomb(store.bury(pending["prefix"], None, token=f"t{step}"), lambda: None)

        def before() -> None:  # what delete_tomb did before this change
            tomb = store.bury(pending["prefix"], None, token=f"t{step}")
            assert tomb.folder is not None
            store._remove_tree(store.write_path(tomb.folder))
            content.sweep()

        wall, _cpu = run_rounds({BASE: before, NOW: now}, args.rounds, before=prepare)
        assert stored(store) == args.contents  # the last prune's contents went, the others stayed
    print(f"a prune of a checkpoint of {args.files} files with {args.contents} other contents stored")
    table("prune (bury + delete_tomb)", wall, BASE)
    print(load_line(load0))
    print(f"prune_contents: {args.contents} other contents, prune {statistics.median(wall[NOW]) * 1e3:.2f} ms "
          f"vs before {statistics.median(wall[BASE]) * 1e3:.2f} ms (median)")


if __name__ == "__main__":
    main()
