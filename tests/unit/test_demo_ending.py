"""``make demo`` ends by telling the user how to keep the UI up and what it left on disk, where."""

from __future__ import annotations

from ckpt.demo import closing_lines
from core.space import folder_bytes


def test_the_demo_ends_with_how_to_keep_the_ui_and_the_disk_it_left(tmp_path):
    data = tmp_path / ".demo"
    (data / "tier1").mkdir(parents=True)
    (data / "tier1" / "shard").write_bytes(b"x" * 3_000_000)
    lines = closing_lines(data, folder_bytes(data), kept_running=False)
    assert "--keep-running" in lines[0]
    assert lines[-1].startswith("left on disk: 3.00 MB under " + str(data.absolute()))
    assert f"rm -rf {data}" in lines[-1]


def test_a_demo_kept_running_ends_with_the_disk_alone(tmp_path):
    lines = closing_lines(tmp_path, 0, kept_running=True)
    assert len(lines) == 1 and "left on disk: 0 B under" in lines[0] and "--keep-running" not in lines[0]
