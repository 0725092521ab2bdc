"""The per-run status page (flows/status.py) as plain markdown, and the RPO automation's
definition and late-event template (deployments/automations.py), without Prefect's server."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from core import events, sizing
from db.entities import LineageEdge
from flows.artifacts import artifact_key
from flows.status import FailedRun, Failure, RunStatus, TierNewest, lineage_line, status_markdown

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def _status(**kw) -> RunStatus:
    base = dict(
        run="run-b",
        newest=[TierNewest(0, 500, T0), TierNewest(1, 400, T0 + timedelta(seconds=30)), TierNewest(2, None)],
        time_to_durable=[(300, 4.0), (400, 6.5)],
        figure=sizing.measured("run-b", [(T0, 2.0), (T0 + timedelta(seconds=98), 2.0)]),
        newest_step=500,
        lineage=[LineageEdge("run-b", 500, "run-b", 400, "follows", 1),
                 LineageEdge("run-b", 400, "run-b", 300, "follows", 2),
                 LineageEdge("run-b", 300, "run-a", 200, "resumed_from", 3),
                 LineageEdge("run-a", 200, "run-a", 100, "follows", 4)],
        checkpoints=3, generated_at=T0)
    base.update(kw)
    return RunStatus(**base)


def test_status_markdown_has_every_section():
    md = status_markdown(_status())
    assert md.startswith("# Run `run-b`")
    assert "| Tier 0 (node NVMe) | 500 |" in md and "| Tier 1 (shared FS) | 400 |" in md
    assert "| Tier 2 (object store) | — | — |" in md
    assert "newest durable, step 400: **6.50 s**" in md
    assert "median of the last 2" in md
    # two saves of 2 s stall, 98 s apart: 4 / 100 = 4 %
    assert "**ΔMFU: 4.00 %**" in md, md
    assert "`run-b` steps 300..500 (3) ← *resumed from* `run-a` steps 100..200 (2)" in md


def test_status_markdown_shows_a_diverged_checkpoint_s_metrics_as_nan_and_inf():
    diverged = {"loss": float("nan"), "grad_norm": float("inf"), "lr": 3e-4}
    md = status_markdown(_status(newest_step=500, metrics=diverged))
    assert "Metrics of the newest checkpoint (step 500): grad_norm=inf, loss=nan, lr=0.0003" in md


def test_status_markdown_of_a_new_run():
    md = status_markdown(_status(newest=[TierNewest(t, None) for t in (0, 1, 2)], time_to_durable=[],
                                 figure=None, newest_step=None, lineage=[], checkpoints=0))
    assert "no checkpoint of this run is durable yet" in md
    assert "no writer stall recorded" in md
    assert "- no checkpoint" in md


def test_at_a_glance_answers_durable_late_failed_and_repaired_and_bytes_per_tier():
    """What the platform engineer asks first, at the top of the page: the newest durable
    checkpoint, what is late past the RPO, which promote runs failed and which of them something
    repaired since (by whom, when), and each tier's bytes."""
    repaired = Failure(FailedRun("promote/run-b/step-300", 300, T0, "OSError: Tier 1 full", "fr-1"),
                       repaired_by="reconcile/node-0", repaired_at=T0 + timedelta(minutes=2))
    open_ = Failure(FailedRun("promote/run-b/step-500", 500, T0 + timedelta(minutes=5),
                              "CorruptCheckpoint:\nbad | crc"))
    md = status_markdown(_status(durable_step=400, durable_at=T0 + timedelta(seconds=30), rpo_seconds=900,
                                 late=[(500, T0 + timedelta(minutes=4))], failures=[open_, repaired],
                                 tier_bytes={0: (1, 3_000_000), 1: (2, 6_000_000_000)}))
    glance = md[md.index("## At a glance"):md.index("## Newest verified checkpoint per tier")]
    assert ("**Newest durable checkpoint** (every part verified on Tier 1): step **400**, "
            "durable since 2025-01-01 12:00:30 UTC") in glance
    assert ("**Late past the RPO** (900 s): 1 checkpoint(s) not on Tier 1: "
            "step 500 (committed 2025-01-01 12:04:00 UTC)") in glance
    assert ("| `promote/run-b/step-300` | 300 | 2025-01-01 12:00:00 UTC | OSError: Tier 1 full | "
            "failed, repaired by `reconcile/node-0` at 2025-01-01 12:02:00 UTC |") in glance
    assert ("| `promote/run-b/step-500` | 500 | 2025-01-01 12:05:00 UTC | CorruptCheckpoint: bad / crc | "
            "**failed, not repaired** |") in glance  # one table row: no newline, no cell split
    assert "| Tier 0 (node NVMe) | 1 | 3.00 MB |" in glance and "| Tier 1 (shared FS) | 2 | 6.00 GB |" in glance
    assert "| Tier 2 (object store) | 0 | 0 B |" in glance


def test_at_a_glance_of_a_healthy_new_run_and_an_orchestrator_that_did_not_answer():
    md = status_markdown(_status(rpo_seconds=900, failures=[]))
    assert "(every part verified on Tier 1): none yet" in md
    assert "**Late past the RPO** (900 s): none" in md
    assert "### Failed promote runs\n\n- none" in md
    assert "- not known: the orchestrator did not answer" in status_markdown(_status(failures=None))


def test_lineage_line_single_checkpoint_and_branch():
    assert lineage_line("r", 7, []) == "`r` step 7"
    edges = [LineageEdge("r", 7, "base", 3, "fine_tuned_from", 1)]
    assert lineage_line("r", 7, edges) == "`r` step 7 ← *fine tuned from* `base` step 3"


def test_artifact_key_of_a_run_is_valid():
    assert artifact_key("run", "My_Run.v2") == "run-my-run-v2"


def test_rpo_trigger_is_proactive_per_checkpoint():
    from deployments.automations import rpo_trigger

    t = rpo_trigger(900)
    assert t.posture == "Proactive" and t.after == {events.COMPLETED} and t.expect == {events.DURABLE}
    assert t.for_each == {"prefect.resource.id"} and t.threshold == 1
    assert t.within == timedelta(seconds=900)


def test_late_event_template_renders_a_valid_event():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from deployments.automations import late_payload

    completed = events.build_event(events.COMPLETED, "run-a", 1200, part=1, parts=2, node="gpu-7")
    res = completed["resource"]
    ctx = {"event": SimpleNamespace(id=completed["id"], occurred=T0,
                                    resource={**res, "id": res["prefect.resource.id"],
                                              "name": res["prefect.resource.name"]}),
           "firing": SimpleNamespace(id="0190b3c2-0000-7000-8000-000000000001", triggered=T0 + timedelta(minutes=15)),
           "automation": SimpleNamespace(id="a-1", name="ckpt-rpo-late")}
    body = json.loads(ImmutableSandboxedEnvironment().from_string(late_payload(900)).render(**ctx))
    (ev,) = body
    assert ev["event"] == events.LATE
    assert ev["resource"]["prefect.resource.id"] == "ckpt.checkpoint.run-a.1200"
    assert ev["resource"]["ckpt.node"] == "gpu-7"
    assert ev["payload"] == {"run": "run-a", "step": 1200, "node": "gpu-7", "rpo_seconds": 900,
                             "completed_event": completed["id"], "completed_at": T0.isoformat()}
    assert ev["occurred"] == (T0 + timedelta(minutes=15)).isoformat()


# --- gather: what the page reads from the catalog ---------------------------------------------
def _filled_run(cat, run: str, n: int) -> None:
    """``n`` checkpoints saving every 100 s with a stall of 1-3 s; the newest five verified on
    Tier 1 (some time after their commit) and the newest on Tier 0."""
    from core.manifest import FileEntry, Manifest
    from tests.kit.catalog import verified

    cat.ensure_run(run, actor="test")
    cat.register_many([Manifest(run=run, step=10 * (i + 1), files=(FileEntry("f.bin", 10, "00000000"),),
                                writer_stall_seconds=1.0 + i % 3,
                                created_at=(T0 + timedelta(seconds=100 * i)).isoformat()) for i in range(n)],
                      actor="test")
    for c in cat.newest_checkpoints(run, 5):
        verified(cat, c.id, 1)
    verified(cat, cat.newest_checkpoints(run, 1)[0].id, 0)


def _statements(cat, fn) -> int:
    from sqlalchemy import event

    seen: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        seen.append(statement)

    event.listen(cat.engine, "before_cursor_execute", count)
    try:
        fn()
    finally:
        event.remove(cat.engine, "before_cursor_execute", count)
    return len(seen)


def _gather_whole_run(cat, run: str) -> RunStatus:
    """The page's figures read the way the page once did: every checkpoint of the run and one
    ``locations`` per recent checkpoint (the reference for a small run)."""
    from flows.status import RECENT, TIERS, gather

    page = gather(cat, run)
    ckpts = sorted(cat.list_checkpoints(run), key=lambda c: c.step)
    ttd = []
    for c in ckpts[-RECENT:]:
        loc = next((x for x in cat.locations(run, c.step) if x.tier == 1), None)
        if loc is not None:
            ttd.append((c.step, max(0.0, (loc.verified_at - (c.committed_at or c.created_at)).total_seconds())))
    figure = sizing.measured(run, [(c.created_at, c.writer_stall_seconds) for c in ckpts
                                   if c.writer_stall_seconds is not None])
    assert [n.tier for n in page.newest] == list(TIERS)
    return RunStatus(run, page.newest, ttd, figure, ckpts[-1].step, cat.ancestors(run, ckpts[-1].step, max_depth=500),
                     len(ckpts))


def test_gather_reads_the_same_few_statements_however_large_the_run(catalog, monkeypatch):
    from flows import status

    monkeypatch.setattr(status, "STALL_WINDOW", 50, raising=False)
    _filled_run(catalog, "small", 30)
    _filled_run(catalog, "large", 300)
    failed = [FailedRun("promote/x/step-10", 10, T0), FailedRun("promote/x/step-20", 20, T0)]
    small = _statements(catalog, lambda: status.gather(catalog, "small", rpo_seconds=900, failed=failed))
    large = _statements(catalog, lambda: status.gather(catalog, "large", rpo_seconds=900, failed=failed))
    # not one or more per recent checkpoint (RECENT = 20: 60 more); 2 for the drills; one audit
    # trail per failed run shown (at most FAILURES); 2 for whether their checkpoints are held now
    assert small == large <= 50
    page = status.gather(catalog, "large")
    assert page.checkpoints == 300 and page.newest_step == 3000 and len(page.time_to_durable) == 5
    assert page.figure is not None and page.figure.checkpoints == 50
    assert "median 2.00 s over the last 50 saves" in status_markdown(page)
    assert "over 30 save(s)" in status_markdown(status.gather(catalog, "small"))


def test_gather_of_a_small_run_matches_reading_the_whole_run(catalog):
    from dataclasses import replace

    from flows.status import gather

    _filled_run(catalog, "run-s", 30)
    page = gather(catalog, "run-s")
    assert replace(page, durable_step=None, durable_at=None, tier_bytes={}) == _gather_whole_run(catalog, "run-s")
    assert [s for s, _ in page.time_to_durable] == [260, 270, 280, 290, 300]
    assert page.figure is not None and page.figure.checkpoints == 30 and page.figure.median_interval_seconds == 100


def test_status_page_shows_the_newest_drills():
    from db.entities import DrillResult

    drills = [DrillResult(2, "run-b", 400, 2, True, 41.5, 980_000_000, T0, nodes=16, bound_seconds=38.0,
                          tier_bytes={"2": 980_000_000}, node_seconds=[40.0] * 16),
              DrillResult(1, "run-b", 400, 1, False, 3.0, 0, T0, detail="part 3: corrupt", nodes=16)]
    md = status_markdown(_status(drills=drills))
    assert "## Recovery drills (RTO: first start → last part loaded)" in md
    assert "| 2 | 400 | 16 | ok | 41.5 s | 38.0 s | 980 MB |" in md
    assert "| 1 | 400 | 16 | **FAILED** | 3.00 s | — | 0 B |" in md
    assert "no drill recorded for this run" in status_markdown(_status())


def test_gather_finds_the_durable_newest_the_late_the_repaired_and_the_bytes(catalog):
    """From the catalog: 30 checkpoints committed (by the catalog's clock: now, so late past an RPO
    of 0 s, not of 900 s), the newest five verified on Tier 1, two of them recorded complete there,
    one by reconcile; a promote run that failed on that one reads repaired by reconcile, one on a
    late checkpoint not."""
    from flows.status import LATE, gather

    _filled_run(catalog, "run-g", 30)
    newest = catalog.newest_checkpoints("run-g", 2)
    assert catalog.complete_on_tier(newest[1].id, 1, actor="event flow-run:e1")
    assert catalog.complete_on_tier(newest[0].id, 1, actor="reconcile/node-0")
    failed = [FailedRun("promote/run-g/step-300", 300, T0), FailedRun("promote/run-g/step-10", 10, T0)]
    assert gather(catalog, "run-g", rpo_seconds=900).late == []
    page = gather(catalog, "run-g", now=T0, rpo_seconds=0, failed=failed)
    assert page.durable_step == 300 and page.durable_at is not None
    assert [step for step, _ in page.late] == [10 * (i + 1) for i in range(LATE)]  # the oldest first
    assert page.tier_bytes == {0: (1, 2000), 1: (5, 10_000)}
    repaired, open_ = page.failures
    assert (repaired.repaired_by, open_.repaired_by) == ("reconcile/node-0", None)
    md = status_markdown(page)
    assert "failed, repaired by `reconcile/node-0` at" in md and "**failed, not repaired**" in md
    assert "lost since" not in md

    # step 300's Tier 1 copy vanishes later: the repair stands, and the page says it no longer holds
    (rep,) = catalog.replicas(newest[0].id, tier=1)
    catalog.transition(rep.id, "missing", actor="reconcile/node-0", reason="files gone")
    repaired, _ = gather(catalog, "run-g", now=T0, rpo_seconds=0, failed=failed).failures
    assert repaired.repaired_by == "reconcile/node-0" and repaired.durable_now is False
    assert "repaired by `reconcile/node-0` at " in (md := status_markdown(
        gather(catalog, "run-g", now=T0, rpo_seconds=0, failed=failed)))
    assert "**lost since: no whole copy on Tier 1 or 2 now**" in md


def test_status_page_shows_the_run_s_storage_per_tier(catalog, db_url, settings_factory):
    """The page's storage section: what each tier holds of this run (another run's copies and
    hops left out), its hops' bandwidth and first-byte latency, and the monthly cost at the
    configured price; the page reads the same few statements with it, however large the run."""
    from flows import status
    from tests.kit.catalog import checkpoint, timed_hop

    gb = 10**9
    a, b = checkpoint(catalog, "run-s", 10, size=gb), checkpoint(catalog, "run-s", 20, size=gb)
    timed_hop(catalog, a.id, 1, seconds=2.0, first_byte=0.01, bytes=2 * gb)
    timed_hop(catalog, b.id, 1, seconds=1.0, first_byte=0.05, bytes=2 * gb)
    timed_hop(catalog, checkpoint(catalog, "other", 10, size=gb).id, 1, seconds=0.01, bytes=2 * gb)
    settings = settings_factory(catalog_url=db_url, tier1_price_gb_month=2.0)

    page = status.gather(catalog, "run-s", settings=settings)
    md = status_markdown(page)
    assert "## Storage per tier" in md
    assert ("| Tier 1 (shared FS) | 2 | 4.00 GB | 4.00 GB | 1.00× | 1.50 GB/s / 1.00 GB/s (2) | — | "
            "30 ms / 50 ms (2) | 8.00 |") in md, md
    assert "| Tier 0 (node NVMe) | 0 | 0 B | 0 B | — | — | — | — | 0.00 |" in md
    assert "## Storage per tier" not in status_markdown(status.gather(catalog, "run-s"))  # no settings: no prices

    _filled_run(catalog, "large", 300)

    def storage_statements(run: str) -> int:
        return (_statements(catalog, lambda: status.gather(catalog, run, settings=settings))
                - _statements(catalog, lambda: status.gather(catalog, run)))

    assert storage_statements("run-s") == storage_statements("large") <= 12  # a fixed few, per tier at most
