"""The catalog's query commands, through the real CLI on a real catalog (both backends)."""

from __future__ import annotations

import json
import sys

import pytest

from ckpt.cli import main
from tests.kit.catalog import catalog_cli, checkpoint, manifest, verified


@pytest.fixture
def cli(catalog, db_url, monkeypatch, tmp_path):
    return catalog_cli(monkeypatch, tmp_path, db_url)


def _story(cat):
    """base: steps 10, 20 (verified on tier 1, 20 also on tier 2); ft fine-tuned from base/20."""
    for step in (10, 20):
        ck = checkpoint(cat, "base", step)
        verified(cat, ck.id, 1)
    verified(cat, ck.id, 2)
    cat.ensure_run("ft", parent=("base", 20), parent_relation="fine_tuned_from")
    cat.register_part(manifest("ft", 1), actor="t")


def test_ls_json_lists_checkpoints_with_verified_tiers(cli, catalog):
    _story(catalog)
    rows = json.loads(cli("ls", "--json"))
    assert [(r["run"], r["step"], r["verified_tiers"]) for r in rows] == [
        ("base", 10, [1]), ("base", 20, [1, 2]), ("ft", 1, [])]
    assert [r["step"] for r in json.loads(cli("ls", "--run", "ft", "--json"))] == [1]
    table = cli("ls")
    assert "base" in table and "2:object" in table


def test_locate_prints_one_object_per_replica(cli, catalog):
    _story(catalog)
    reps = json.loads(cli("locate", "base", "20", "--json"))
    assert [(r["tier"], r["state"], r["bytes"]) for r in reps] == [(1, "verified", 2000), (2, "verified", 2000)]
    assert all(r["url"] and r["verified_at"].endswith("+00:00") for r in reps)


def test_latest_show_and_pin(cli, catalog):
    _story(catalog)
    latest = json.loads(cli("latest", "base", "--json"))
    assert latest["checkpoint"]["step"] == 20 and [loc["tier"] for loc in latest["locations"]] == [1, 2]
    assert json.loads(cli("latest", "base", "--tier", "2", "--json"))["checkpoint"]["step"] == 20
    assert json.loads(cli("pin", "base", "10", "--reason", "paper", "--json")) == {"run": "base", "step": 10,
                                                                                   "pinned": True}
    shown = json.loads(cli("show", "base", "10", "--json"))
    assert shown["pinned"] is True and shown["checkpoint"]["state"] == "committed"
    assert [r["tier"] for r in shown["replicas"]] == [1]
    assert "kept by: pin" in cli("show", "base", "10")
    cli("unpin", "base", "10")
    assert json.loads(cli("show", "base", "10", "--json"))["pinned"] is False


def test_lineage_tree_and_json(cli, catalog):
    _story(catalog)
    edges = json.loads(cli("lineage", "ft", "1", "--json"))
    assert [(e["parent_run"], e["parent_step"], e["relation"]) for e in edges] == [
        ("base", 20, "fine_tuned_from"), ("base", 10, "follows")]
    tree = cli("lineage", "base", "10", "--descendants")
    assert "base/20 (follows)" in tree and "ft/1 (fine_tuned_from)" in tree


def test_errors_are_one_clear_line(cli, catalog, monkeypatch, capsys):
    _story(catalog)
    for argv, text in ((["show", "ghost", "1"], "unknown run 'ghost'"),
                       (["latest", "ft"], "no verified checkpoint"),
                       (["show", "base", "99"], "no checkpoint at step 99")):
        monkeypatch.setattr(sys, "argv", ["ckpt", *argv])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 1
        assert len(err.splitlines()) == 1 and text in err and "Traceback" not in err


def test_show_prints_the_checkpoint_history_with_actor_and_reason(cli, catalog):
    _story(catalog)
    catalog.pin("base", 20, reason="paper result", actor="alice")
    doc = json.loads(cli("show", "base", "20", "--json"))
    actions = [(h["action"], h["actor"]) for h in doc["history"]]
    assert ("pin", "alice") in actions and any(a == "register" for a, _ in actions)
    assert any(h["to_state"] == "verified" for h in doc["history"])
    table = cli("show", "base", "20")
    assert "history" in table and "alice" in table


def test_audit_lists_rejections_first_and_filters_by_run_and_time(cli, catalog):
    _story(catalog)
    catalog.record_rejection("checkpoint:ft/2/part-0", "CorruptCheckpoint: bad shard", actor="flow-run:x",
                             run="ft", step=2)
    catalog.pin("ft", 1, actor="bob")  # newer than the rejection
    rows = json.loads(cli("audit", "--json"))
    assert rows[0]["action"] == "reject" and rows[0]["reason"] == "CorruptCheckpoint: bad shard"
    assert rows[1]["action"] == "pin"  # then everything else, newest first
    assert {r["run"] for r in json.loads(cli("audit", "--run", "base", "--json"))} == {"base"}
    assert json.loads(cli("audit", "--since", "2000-01-01T00:00:00", "--json")) == rows
    assert json.loads(cli("audit", "--since", "2999-01-01T00:00:00+00:00", "--json")) == []
    assert "bad shard" in cli("audit", "--since", "1h")


LONG_RUN = "llama-70b-sft-sweep-lr3e-5-warmup-2000-seed-17-" + "x" * 30


def test_tables_fit_80_columns_and_history_reads_who_acted(cli, catalog, monkeypatch):
    """At 80 columns a run name too long for its column is shortened in its middle (its start
    and end stay, ``--json`` prints it whole), no line is wider than the terminal, and the
    history names who acted by role, not by flow-run id or pid."""
    monkeypatch.setenv("COLUMNS", "80")
    ck = checkpoint(catalog, LONG_RUN, 10)
    verified(catalog, ck.id, 1)
    catalog.pin(LONG_RUN, 10, actor="reconcile/node-0 flow-run:0b8f6a52-2f7e-4c41-9d1c-1f1d9c4e9a10")
    catalog.unpin(LONG_RUN, 10, actor="retention flow-run:5c1e0f0e-8d3b-4a55-b7a2-9a3cf0d1e2f3")
    catalog.pin(LONG_RUN, 10, actor="event flow-run:77d9e1c4-0a0b-4c2d-8e3f-4a5b6c7d8e9f")
    catalog.unpin(LONG_RUN, 10, actor="cli")
    catalog.pin(LONG_RUN, 10, actor="event agent:node-3 pid:4242")  # a part its agent promoted, no flow run

    listed = cli("ls")
    assert max(len(line) for line in listed.splitlines()) <= 80
    first = listed.splitlines()[3]  # the header takes two lines and a rule
    assert first.startswith(LONG_RUN[:6]) and LONG_RUN[-6:] in first and "…" in first
    assert [c["run"] for c in json.loads(cli("ls", "--json"))] == [LONG_RUN]
    shown = cli("show", LONG_RUN, "10")
    assert max(len(line) for line in shown.splitlines()) <= 80
    history = shown.split("history", 1)[1]
    for role in ("reconcile/node-0", "retention", "event", "cli", "agent:node-3"):
        assert role in history
    assert "flow-run" not in history and "pid:" not in history
    doc = json.loads(cli("show", LONG_RUN, "10", "--json"))
    assert "reconcile/node-0 flow-run:0b8f6a52-2f7e-4c41-9d1c-1f1d9c4e9a10" in [h["actor"] for h in doc["history"]]
    assert "event agent:node-3 pid:4242" in [h["actor"] for h in doc["history"]]


def test_a_diverged_checkpoint_shows_nan_and_inf(cli, catalog):
    """``show`` prints a non-finite metric as ``nan``/``inf``; its ``--json`` stays JSON a strict
    parser reads (no ``NaN`` token), the value as the string ``"nan"``/``"inf"``."""
    checkpoint(catalog, "base", 10, metrics={"loss": float("nan"), "grad_norm": float("inf"), "lr": 0.5})
    shown = cli("show", "base", "10", "--json")
    doc = json.loads(shown, parse_constant=lambda token: pytest.fail(f"{token} is not JSON"))
    assert doc["checkpoint"]["metrics"] == {"loss": "nan", "grad_norm": "inf", "lr": 0.5}
    assert "metrics: grad_norm=inf, loss=nan, lr=0.5" in cli("show", "base", "10")


def test_a_bad_argument_is_one_line_and_a_recorded_rejection(cli, catalog, monkeypatch, capsys, tmp_path):
    """A step that is not ASCII digits (``int()`` takes ``1_0``, ``10\\n`` and full-width digits
    as 10), one out of range, a malformed RUN:STEP, any other number read leniently or out of
    range, an unknown option, a missing argument: exit 2, one line, and each is in the
    catalog's audit as a rejection of the command line, as a malformed event is."""
    _story(catalog)
    bad = (["show", "base", "\uff11\uff10"], ["pin", "base", "1_0"], ["locate", "base", "10\n"],
           ["promote", "--run", "base", "--step", "-1"], ["promote", "--run", "base", "--step", "10", "--part", "+0"],
           ["commit", str(tmp_path), "--run", "base", "--step", "30", "--parent", "base:\uff11\uff10"],
           ["restore", "base", "--to", str(tmp_path / "out"), "--step", "1e1"],
           # every other whole number by the same rule, and typer's own usage errors
           ["latest", "base", "--tier", "1_0"], ["lineage", "base", "10", "--depth", "\uff15"],
           ["drill", "--nodes", "x"],
           ["drills", "--limit", "0"], ["drills", "--bogus"], ["latest"], ["pin", "base"])
    for argv in bad:
        monkeypatch.setattr(sys, "argv", ["ckpt", *argv])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2, argv
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not catalog.is_pinned("base", 10)
    rejected = [a for a in catalog.audit_log(limit=50) if a.action == "reject"]
    assert sorted(a.subject for a in rejected) == sorted(
        "cli:" + " ".join(argv).encode("unicode_escape").decode() for argv in bad)
