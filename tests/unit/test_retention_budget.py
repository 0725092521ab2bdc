"""A tier's byte budget (``RetentionPolicy.max_bytes``): read from human sizes, refused when it
is no size; in the plan, it only ever takes what a tier keeps as ``retention off`` and nothing a
rule keeps (every golden case, each tier given a budget of one byte)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.errors import ConfigError
from core.retention import DEMOTE, KEEP, ReplicaFacts, Rules, plan, stored_bytes
from core.settings import RetentionPolicy, load_settings
from tests.kit.retention_cases import case_files, facts_of, load, now_of, rules_of


@pytest.mark.parametrize("text,size", [("2TB", 2 * 10**12), ("500GiB", 500 * 2**30), ("12345", 12345),
                                       ("1.5 KB", 1500), ("", None)])
def test_a_budget_is_read_from_the_environment_in_human_sizes(monkeypatch, tmp_path, text, size):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_RETENTION_TIER1__MAX_BYTES", text)
    assert load_settings(data_dir=tmp_path).retention(1).max_bytes == size


@pytest.mark.parametrize("text", ["-5", "nan", "inf", "1e400", "lots", "0", "0.5", "2TBs"])
def test_a_budget_that_is_no_size_is_refused_in_one_line(monkeypatch, tmp_path, text):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_RETENTION_TIER2__MAX_BYTES", text)
    with pytest.raises(ConfigError, match=r"retention_tier2\.max_bytes") as exc:
        load_settings(data_dir=tmp_path)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, True])
def test_a_budget_given_as_a_number_must_be_a_finite_size(value):
    with pytest.raises(ValueError, match="max_bytes"):
        RetentionPolicy(max_bytes=value)


def test_what_a_tier_holds_counts_each_stored_copy_once():
    a = ReplicaFacts(replica_id=1, tier=1, part=0, url="file:///t1/a", bytes=100)
    b = ReplicaFacts(replica_id=2, tier=1, part=1, url="file:///t1/b", bytes=50)
    assert stored_bytes([a, b, a]) == 150
    assert stored_bytes([a, replace(a, tier=2)]) == 200  # the same name on another tier is another copy
    assert stored_bytes([replace(a, bytes=None)]) == 0


def _budgeted(rules: Rules) -> Rules:
    return replace(rules, policies={t: p.model_copy(update={"max_bytes": 1}) for t, p in rules.policies.items()})


@pytest.mark.parametrize("path", case_files(), ids=lambda p: p.stem)
def test_a_budget_takes_only_what_no_rule_keeps(path):
    case = load(path)
    facts, rules, now = facts_of(case), rules_of(case), now_of(case)
    free, tight = plan(facts, rules, now), plan(facts, _budgeted(rules), now)
    for was, now_ in zip(free.replicas, tight.replicas, strict=True):
        assert (was.run, was.step, was.tier, was.part) == (now_.run, now_.step, now_.tier, now_.part)
        if was.action != now_.action:
            assert now_.reason.startswith("over budget ("), now_
        if was.action == KEEP and now_.action == DEMOTE:  # a retirement is the checkpoint's (below)
            assert was.reason == "retention off", (was, now_)
        elif was.action != KEEP:
            assert now_.action != KEEP  # the budget never brings back what the rules let go
    for was, now_ in zip(free.checkpoints, tight.checkpoints, strict=True):
        if was.action == KEEP and now_.action != KEEP:
            assert set(was.reason.split(", ")) <= {f"tier {t} retention off" for t in (0, 1, 2)}, was
            assert now_.reason.startswith("over budget ("), now_
    for b in tight.budgets:
        kept = [d for d in tight.replicas if d.action == KEEP and d.tier == b.tier]
        assert all(d.reason != "retention off" for d in kept)  # over a budget, nothing stays only for that
        assert b.over == (b.kept_bytes > 1)


def test_tier0s_budget_is_each_nodes_own():
    """Tier 0 is each node's NVMe: a node over its budget loses its oldest copies; a node within
    it keeps its own, older or not."""
    from datetime import UTC, datetime, timedelta

    from core.retention import CheckpointFacts

    now = datetime(2026, 6, 1, tzinfo=UTC)

    def ck(run: str, step: int, node: str, age: float) -> CheckpointFacts:
        at = now - timedelta(days=age)
        reps = (ReplicaFacts(replica_id=step * 10, tier=0, part=0, node=node, bytes=100),
                ReplicaFacts(replica_id=step * 10 + 1, tier=1, part=0, bytes=100))
        return CheckpointFacts(run=run, step=step, created_at=at, committed_at=at, replicas=reps)

    facts = [ck("a", 1, "n0", 9), ck("a", 2, "n0", 8), ck("a", 3, "n0", 1), ck("b", 1, "n1", 10), ck("b", 2, "n1", 2)]
    rules = Rules(policies={0: RetentionPolicy(enabled=False, max_bytes=250), 1: RetentionPolicy(enabled=False)})
    decided = plan(facts, rules, now)

    tier0 = {(d.run, d.step): (d.action, d.reason) for d in decided.replicas if d.tier == 0}
    assert tier0 == {("a", 1): ("demote", "over budget (300 of 250 bytes)"), ("a", 2): ("keep", "retention off"),
                     ("a", 3): ("keep", "newest verified, retention off"), ("b", 1): ("keep", "retention off"),
                     ("b", 2): ("keep", "newest verified, retention off")}
    assert [(b.node, b.kept_bytes, b.over) for b in decided.budgets] == [("n0", 200, False), ("n1", 200, False)]


def test_tier0s_budget_takes_a_multi_node_checkpoint_only_when_every_node_holding_it_is_over():
    """A data-parallel job: each node holds one part of every checkpoint, and a Tier 0 eviction
    takes the checkpoint's parts on every node. Every node over its budget: the oldest go from
    all of them. One node within its budget: that checkpoint stays everywhere, and the budget of
    the node over it names what holds the excess."""
    from datetime import UTC, datetime, timedelta

    from core.retention import CheckpointFacts

    now = datetime(2026, 6, 1, tzinfo=UTC)

    def ck(step: int, age: float, sizes: dict[str, int]) -> CheckpointFacts:
        at = now - timedelta(days=age)
        reps = []
        for part, (node, size) in enumerate(sorted(sizes.items())):
            reps += [ReplicaFacts(replica_id=step * 10 + 2 * part, tier=0, part=part, node=node, bytes=size),
                     ReplicaFacts(replica_id=step * 10 + 2 * part + 1, tier=1, part=part, bytes=size)]
        return CheckpointFacts(run="r", step=step, created_at=at, committed_at=at, parts=len(sizes),
                               replicas=tuple(reps))

    rules = Rules(policies={0: RetentionPolicy(enabled=False, max_bytes=250), 1: RetentionPolicy(enabled=False)})
    even = [ck(step, 10 - step, {"n0": 100, "n1": 100}) for step in (1, 2, 3, 4)]
    decided = plan(even, rules, now)

    tier0 = {(d.step, d.node): (d.action, d.reason) for d in decided.replicas if d.tier == 0}
    for node in ("n0", "n1"):
        assert tier0[(1, node)] == ("demote", "over budget (400 of 250 bytes)")
        assert tier0[(2, node)] == ("demote", "over budget (400 of 250 bytes)")
        assert tier0[(3, node)][0] == tier0[(4, node)][0] == "keep"
    assert [(b.node, b.kept_bytes, b.over) for b in decided.budgets] == [("n0", 200, False), ("n1", 200, False)]

    uneven = [ck(step, 10 - step, {"n0": 100, "n1": 10}) for step in (1, 2, 3, 4)]  # n1 holds 40 bytes
    decided = plan(uneven, rules, now)

    assert {d.action for d in decided.replicas if d.tier == 0} == {"keep"}
    n0 = next(b for b in decided.budgets if b.node == "n0")
    assert n0.over and n0.kept_bytes == 400
    assert dict(n0.held_by)["retention off, on other nodes too"] == 400  # n1 keeps them all


def test_tier0s_budget_asks_a_node_again_once_its_older_pick_is_refused():
    """Step 1 lies on n1 and n2, step 2 on n0 and n1, step 3 on n0 alone; 100 bytes a copy, a
    budget of 150. n1 first picks step 1 (its oldest), which n2, within its budget, refuses;
    n1 is then asked again and takes step 2 with n0: both end within their budgets."""
    from datetime import UTC, datetime, timedelta

    from core.retention import CheckpointFacts

    now = datetime(2026, 6, 1, tzinfo=UTC)

    def ck(step: int, nodes: tuple[str, ...]) -> CheckpointFacts:
        at = now - timedelta(days=10 - step)
        reps = []
        for part, node in enumerate(nodes):
            reps += [ReplicaFacts(replica_id=step * 10 + 2 * part, tier=0, part=part, node=node, bytes=100),
                     ReplicaFacts(replica_id=step * 10 + 2 * part + 1, tier=1, part=part, bytes=100)]
        return CheckpointFacts(run="r", step=step, created_at=at, committed_at=at, parts=len(nodes),
                               replicas=tuple(reps))

    rules = Rules(policies={0: RetentionPolicy(enabled=False, max_bytes=150), 1: RetentionPolicy(enabled=False)})
    decided = plan([ck(1, ("n1", "n2")), ck(2, ("n0", "n1")), ck(3, ("n0",))], rules, now)

    tier0 = {(d.step, d.node): d.action for d in decided.replicas if d.tier == 0}
    assert tier0 == {(1, "n1"): "keep", (1, "n2"): "keep", (2, "n0"): "demote", (2, "n1"): "demote",
                     (3, "n0"): "keep"}
    assert [(b.node, b.kept_bytes, b.over) for b in decided.budgets] == [
        ("n0", 100, False), ("n1", 100, False), ("n2", 100, False)]


def test_a_budget_set_alone_keeps_the_rest_of_the_tiers_default_policy(monkeypatch, tmp_path):
    """``CKPT_RETENTION_TIER2__MAX_BYTES`` alone must not turn Tier 2's retention on with no keep
    rule (which would let most of the archive go), nor a Tier 1 budget drop its ``keep_last``;
    ``none`` unsets a rule of the default, and a policy given whole still replaces it whole."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_RETENTION_TIER2__MAX_BYTES", "50TB")
    monkeypatch.setenv("CKPT_RETENTION_TIER1__MAX_BYTES", "2TB")
    settings = load_settings(data_dir=tmp_path)
    tier2, tier1 = settings.retention(2), settings.retention(1)
    assert (tier2.enabled, tier2.max_bytes, tier2.keep_last) == (False, 50 * 10**12, None)
    assert (tier1.enabled, tier1.max_bytes, tier1.keep_last) == (True, 2 * 10**12, 10)
    monkeypatch.setenv("CKPT_RETENTION_TIER1__KEEP_LAST", "none")
    assert load_settings(data_dir=tmp_path).retention(1).keep_last is None
    whole = load_settings(data_dir=tmp_path, retention_tier2=RetentionPolicy(top_k=1, metric="loss"))
    assert (whole.retention(2).enabled, whole.retention(2).max_bytes) == (True, None)


def test_a_budget_counts_a_shared_content_once_and_frees_only_what_nothing_else_references():
    """On a tier that stores each content once, four checkpoints of one frozen base and their own
    adapters hold base + 4 adapters: that fits a budget of base + 4 adapters (counted per copy
    it would be four bases, and the oldest would go), and over a smaller budget the oldest goes
    for what it alone holds (its adapter), not for the base the others still reference."""
    from datetime import UTC, datetime, timedelta

    from core.retention import CheckpointFacts

    now = datetime(2026, 6, 1, tzinfo=UTC)
    base, adapter = (1000, "base-crc"), (10, "adapter-crc")

    def ck(step: int) -> CheckpointFacts:
        at = now - timedelta(days=10 - step)
        mine = (adapter[0], f"{adapter[1]}-{step}")
        reps = (ReplicaFacts(replica_id=step * 10, tier=1, part=0, url=f"file:///t1/{step}", bytes=1010),
                ReplicaFacts(replica_id=step * 10 + 1, tier=2, part=0, url=f"s3://b/{step}", bytes=1010,
                             contents=(base, mine)))
        return CheckpointFacts(run="ft", step=step, created_at=at, committed_at=at, replicas=reps)

    facts = [ck(s) for s in (1, 2, 3, 4)]
    assert stored_bytes(r for c in facts for r in c.replicas if r.tier == 2) == 1000 + 4 * 10

    def tier2(max_bytes: int):
        rules = Rules(policies={0: RetentionPolicy(enabled=False), 1: RetentionPolicy(enabled=False),
                                2: RetentionPolicy(enabled=False, max_bytes=max_bytes)}, tier2_on=True)
        decided = plan(facts, rules, now)
        return ({d.step: d.action for d in decided.replicas if d.tier == 2},
                [(b.kept_bytes, b.over) for b in decided.budgets])

    assert tier2(1040) == ({1: KEEP, 2: KEEP, 3: KEEP, 4: KEEP}, [(1040, False)])
    actions, budgets = tier2(1035)  # one adapter too many: the oldest copy goes, the base stays held
    assert actions == {1: DEMOTE, 2: KEEP, 3: KEEP, 4: KEEP} and budgets == [(1030, False)]
