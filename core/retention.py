"""The retention rule, in one place: plain facts about each checkpoint + each tier's policy +
the clock -> a plan that says, per replica, *keep* or *demote* and, per checkpoint, *keep* or
*retire*, each with the rule that decided it. No I/O: ``db/`` fetches the facts, ``tasks/``
applies the plan through the guarded operations (which check the rows and the bytes again).

What each tier keeps (the README's table says the same):

- Tier 0 is scratch: its ``keep_last`` (and other keep rules), plus whatever is not yet durable
  (not complete on Tier 1 or 2); a milestone leaves it once durable above, like any other
  checkpoint (Tier 1 holds it for the archive).
- Tier 1 keeps its keep rules, and milestones until archived (Tier 2 on) or as the archive
  (Tier 2 off).
- Tier 2 keeps by its own policy (``keep_last``, ``top_k``, ``max_age``; off by default, which
  keeps everything) and always within Object Lock; a milestone's archive also stays while another
  tier keeps the checkpoint (demoted, Tier 1 would hold it as not yet archived and upload it again).
- On every tier: a pinned or aliased checkpoint, the newest verified one of its run, and one
  newer than the run's newest durable one (rotate only after the new save is durable). While
  such a newer one exists, the newest durable checkpoint keeps its most durable copy too: it
  is what the run resumes from if the node holding the newer one is lost.
- A parent of another run (``keep_parents``) keeps its most durable copy while the child run
  has any checkpoint.

A copy no rule keeps on its tier is *demoted* when another copy of its part, on another tier
at least as durable, stays (else it is kept as the ``last durable copy``). A checkpoint no tier
keeps and nothing holds is *retired*: recorded first, then every copy goes.

A tier's byte budget (``max_bytes``; Tier 0's per node) counts what the tier holds
(``stored_bytes``). Over it, the copies its policy keeps only as ``retention off`` (no rule, no
hold, no milestone: what a tier with retention off keeps besides) lose that reason, oldest first,
until what stays fits: each then goes as any copy no rule keeps (demoted under the same promise,
or retired), with the reason ``over budget (N of M bytes)``. A Tier 0 eviction takes the
checkpoint's copies on every node, so a checkpoint whose parts lie on several nodes goes only
when every node holding it takes it for its own budget (a data-parallel job's nodes, each over
by the same parts); one that a node within its budget keeps stays everywhere, named in the
other nodes' budgets as ``retention off, on other nodes too``. What a rule keeps never goes for
the budget: the plan's ``budgets`` say what each budgeted tier keeps against its budget and,
over it, the rules that keep the excess.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from core.policy import is_milestone
from core.settings import MilestonePolicy, RetentionPolicy
from core.tiers import ALL_TIERS, Tier

KEEP, DEMOTE, RETIRE = "keep", "demote", "retire"
COMMITTED, RETIRED, SUPERSEDED = "committed", "retired", "superseded"
TIERS = ALL_TIERS


@dataclass(frozen=True)
class ReplicaFacts:
    """One verified copy of one part on one tier."""

    replica_id: int
    tier: int
    part: int
    node: str | None = None
    url: str = ""
    bytes: int | None = None
    locked_until: datetime | None = None  # S3 Object Lock: not deletable before this
    # on a tier that stores each content once: (size, CRC32C) of each file, what the copy's bytes
    # are counted by (empty: the copy is counted by ``bytes``, an object of its own)
    contents: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class CheckpointFacts:
    run: str
    step: int
    created_at: datetime
    parts: int = 1
    kind: str = "step"
    tags: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    committed_at: datetime | None = None
    state: str = COMMITTED  # committed | retired (a retirement recorded, its copies still going) | superseded
    replicas: tuple[ReplicaFacts, ...] = ()
    attempt: str = ""
    superseded_by: str | None = None  # the attempt that resumed from below it (state superseded)
    pinned: bool = False
    aliases: tuple[str, ...] = ()
    children: tuple[str, ...] = ()  # other runs descending from it that still have a checkpoint

    def on(self, tier: int) -> bool:
        return any(r.tier == tier for r in self.replicas)

    def complete(self, tier: int) -> bool:
        return len({r.part for r in self.replicas if r.tier == tier}) >= self.parts

    @property
    def durable(self) -> bool:
        return any(self.complete(t) for t in TIERS if t.durable)

    @property
    def verified(self) -> bool:
        return any(self.complete(t) for t in TIERS)


@dataclass(frozen=True)
class Rules:
    """Each tier's policy and the switches that change what the tiers keep."""

    policies: Mapping[int, RetentionPolicy]
    milestones: MilestonePolicy = field(default_factory=MilestonePolicy)
    tier2_on: bool = False
    keep_parents: bool = True


@dataclass(frozen=True)
class ReplicaDecision:
    run: str
    step: int
    tier: int
    part: int
    replica_id: int
    node: str | None
    url: str
    bytes: int | None
    action: str  # keep | demote | retire
    reason: str
    attempt: str = ""
    contents: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class CheckpointDecision:
    run: str
    step: int
    action: str  # keep | retire
    reason: str
    attempt: str = ""


@dataclass(frozen=True)
class Budget:
    """One budgeted tier (Tier 0: one node's) after the plan: ``kept_bytes`` against ``max_bytes``;
    ``wanted_bytes``: what it would keep without the budget (the N of ``over budget (N of M
    bytes)``); over budget, ``held_by``: each rule that keeps the excess with the bytes it keeps
    there (a copy kept by two rules counts for both)."""

    tier: int
    node: str | None
    max_bytes: int
    kept_bytes: int
    wanted_bytes: int
    held_by: tuple[tuple[str, int], ...] = ()

    @property
    def over(self) -> bool:
        return self.kept_bytes > self.max_bytes


@dataclass(frozen=True)
class Plan:
    checkpoints: tuple[CheckpointDecision, ...]
    replicas: tuple[ReplicaDecision, ...]
    budgets: tuple[Budget, ...] = ()


def stored_bytes(copies: Iterable[ReplicaFacts | ReplicaDecision]) -> int:
    """The bytes these copies take where they are stored: each distinct copy once, and on a tier
    that stores each content once (copies with ``contents``) each content once, however many
    checkpoints reference it."""
    return _Held(copies).total


class _Held:
    """What a set of copies holds on their tiers, with references counted: dropping a copy frees
    only the contents no other copy of the set still references."""

    def __init__(self, copies: Iterable[ReplicaFacts | ReplicaDecision]) -> None:
        self.refs: Counter[tuple] = Counter()
        self.total = 0
        for c in copies:
            for key, size in self._units(c):
                self.refs[key] += 1
                self.total += size if self.refs[key] == 1 else 0

    @staticmethod
    def _units(c: ReplicaFacts | ReplicaDecision) -> list[tuple[tuple, int]]:
        if c.contents:
            return [((c.tier, "content", size, crc), size) for size, crc in set(c.contents)]
        return [((c.tier, "copy", c.url or c.replica_id), c.bytes or 0)]

    def drop(self, copies: Iterable[ReplicaFacts | ReplicaDecision]) -> None:
        for c in copies:
            for key, size in self._units(c):
                if self.refs[key] > 0:
                    self.refs[key] -= 1
                    self.total -= size if self.refs[key] == 0 else 0


Evictions = Mapping[int, Mapping[tuple[str, int], str]]  # tier -> (run, step) -> the budget's reason


def plan(facts: Iterable[CheckpointFacts], rules: Rules, now: datetime) -> Plan:
    """The whole policy (see the module doc). Deterministic: sorted by run, step, tier, part."""
    by_run: dict[str, list[CheckpointFacts]] = defaultdict(list)
    for c in facts:
        by_run[c.run].append(c)
    out = _plan_all(by_run, rules, now, {})
    limits = {t: p.max_bytes for t, p in rules.policies.items() if p.max_bytes is not None}
    if not limits:
        return out
    wanted = {g: stored_bytes(ds) for g, ds in _kept(out, limits).items()}
    # oldest first: the writer's stamp of each live checkpoint (a superseded or retired one is
    # never kept as "retention off", so the live one of its step is the only candidate)
    live = {(c.run, c.step): c for cs in by_run.values() for c in cs if c.state not in (RETIRED, SUPERSEDED)}
    evicted: dict[int, dict[tuple[str, int], str]] = defaultdict(dict)
    tried: set[tuple[int, str, int]] = set()
    while True:
        # a copy that stays for the promise (the last durable copy) frees nothing: it loses its
        # "retention off" (its plan line names what really keeps it) and the next oldest is taken
        # too; the plan made again decides, and where it freed less than counted, the next round
        # takes more (each round new ones)
        added = False
        reasons = {(d.run, d.step): d.reason for d in out.checkpoints if d.action == KEEP}
        copies: dict[tuple[str, int], list[ReplicaDecision]] = defaultdict(list)
        for d in out.replicas:
            copies[(d.run, d.step)].append(d)
        groups = _kept(out, limits)
        holders: dict[tuple[str, int], set[str | None]] = defaultdict(set)  # the nodes whose Tier 0 keeps it
        for (t, node), kept in groups.items():
            if t == 0:
                for d in kept:
                    holders[(d.run, d.step)].add(node)
        # a Tier 0 eviction is the checkpoint's on every node: it is taken only when every node
        # that holds it takes it for its own budget (a data-parallel job's nodes, each over by the
        # same parts); one a node under its budget keeps is never taken for another node's
        vetoed: set[tuple[str, int]] = set()
        while True:
            picks: dict[tuple[int, str | None], list[tuple[str, int]]] = {}
            for (t, node), kept in groups.items():
                held, limit = _Held(kept), limits[t]
                candidates = sorted({(live[(d.run, d.step)].created_at, d.run, d.step) for d in kept
                                     if d.reason == "retention off" and (t, d.run, d.step) not in tried
                                     and (t != 0 or (d.run, d.step) not in vetoed)})
                picks[(t, node)] = []
                for _, run, step in candidates:
                    if held.total <= limit:
                        break
                    picks[(t, node)].append((run, step))
                    if _frees(live[(run, step)], t, reasons[(run, step)], copies[(run, step)], rules):
                        held.drop(d for d in kept if (d.run, d.step) == (run, step))
            taken: dict[tuple[str, int], set[str | None]] = defaultdict(set)
            for (t, node), chosen in picks.items():
                if t == 0:
                    for key in chosen:
                        taken[key].add(node)
            refused = {key for key, by in taken.items() if by != holders[key]}
            if not refused:
                break
            # a node within its budget never takes one: final. A node over it that stopped
            # before one (an older pick sufficed) may need it once that pick is refused: asked
            # again first; refused for good only when no node within its budget refuses anything
            within = {node for (t, node), kept in groups.items() if t == 0 and _Held(kept).total <= limits[t]}
            hard = {key for key in refused if holders[key] & within}
            vetoed |= hard or refused
        for (t, node), chosen in sorted(picks.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            limit = limits[t]
            for run, step in chosen:
                if (t, run, step) in tried:  # taken by another node's budget this round: its numbers stand
                    continue
                tried.add((t, run, step))
                over = max(wanted.get((t, n)) or stored_bytes(groups[(t, n)])
                           for n in (holders[(run, step)] if t == 0 else {node}))
                evicted[t][(run, step)] = f"over budget ({over} of {limit} bytes)"
                added = True
        if not added:
            break
        out = _plan_all(by_run, rules, now, evicted)
    final = sorted(_kept(out, limits).items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
    nodes: dict[tuple[str, int], set[str | None]] = defaultdict(set)
    for d in out.replicas:
        if d.tier == 0:
            nodes[(d.run, d.step)].add(d.node)
    spread = {key for key, on in nodes.items() if len(on) > 1}
    budgets = tuple(_budget(t, node, limits[t], kept, wanted.get((t, node), stored_bytes(kept)), spread)
                    for (t, node), kept in final)
    return replace(out, budgets=budgets)


def _plan_all(by_run: Mapping[str, Sequence[CheckpointFacts]], rules: Rules, now: datetime,
              evicted: Evictions) -> Plan:
    cks: list[CheckpointDecision] = []
    reps: list[ReplicaDecision] = []
    for run in sorted(by_run):
        c_out, r_out = _plan_run(sorted(by_run[run], key=lambda c: c.step), rules, now, evicted)
        cks += c_out
        reps += r_out
    return Plan(checkpoints=tuple(cks), replicas=tuple(sorted(reps, key=lambda d: (d.run, d.step, d.tier, d.part))))


def _frees(c: CheckpointFacts, tier: int, why_kept: str, copies: Sequence[ReplicaDecision], rules: Rules) -> bool:
    """Whether ``c``'s copies on ``tier``, no longer kept there as ``retention off``, would go by
    the plan of ``copies`` (its decisions): the checkpoint retired (nothing else keeps it), or each
    copy demoted (its part kept on another tier at least as durable; not a milestone's archive,
    which stays while another tier keeps the checkpoint)."""
    if set(why_kept.split(", ")) <= {f"tier {tier} retention off"}:
        return True
    if tier == 2 and rules.tier2_on and is_milestone(c.kind, c.step, c.tags, rules.milestones):
        return False
    # a more durable tier's copy is planned after this one (its demotion may lean on this copy,
    # which then keeps it as the last durable copy): it backs this copy whatever it is planned now
    backed = {d.part for d in copies if d.tier != tier and Tier(d.tier).as_durable_as(tier)
              and (d.action == KEEP or d.tier > tier)}
    return {r.part for r in c.replicas if r.tier == tier} <= backed


def _kept(p: Plan, limits: Mapping[int, int]) -> dict[tuple[int, str | None], list[ReplicaDecision]]:
    """The copies ``p`` keeps on each budgeted tier, by what one budget covers: the tier, and on
    Tier 0 the node (each node's NVMe is its own)."""
    out: dict[tuple[int, str | None], list[ReplicaDecision]] = defaultdict(list)
    for d in p.replicas:
        if d.action == KEEP and d.tier in limits:
            out[(d.tier, d.node if d.tier == 0 else None)].append(d)
    return out


def _budget(tier: int, node: str | None, limit: int, kept: Sequence[ReplicaDecision], wanted: int,
            spread: Collection[tuple[str, int]] = ()) -> Budget:
    """``tier``'s budget after the plan; over it, the bytes each rule keeps there. On Tier 0, a
    checkpoint with copies on other nodes too (``spread``) that stays (a node within its budget
    keeps it) is named as what holds the excess."""
    total = stored_bytes(kept)
    held: dict[str, list[ReplicaDecision]] = defaultdict(list)
    if total > limit:
        for d in kept:
            for reason in d.reason.split(", "):
                if reason == "retention off" and Tier(tier).node_local and (d.run, d.step) in spread:
                    reason = "retention off, on other nodes too"
                elif reason == "retention off":  # over budget, nothing stays for that reason alone
                    continue
                held["locked until" if reason.startswith("locked until") else reason].append(d)
    by_rule = sorted(((r, stored_bytes(ds)) for r, ds in held.items()), key=lambda rb: (-rb[1], rb[0]))
    return Budget(tier=tier, node=node, max_bytes=limit, kept_bytes=total, wanted_bytes=wanted,
                  held_by=tuple(by_rule))


def _plan_run(cks: Sequence[CheckpointFacts], rules: Rules, now: datetime, evicted: Evictions
              ) -> tuple[list[CheckpointDecision], list[ReplicaDecision]]:
    live = [c for c in cks if c.state not in (RETIRED, SUPERSEDED) and c.replicas]
    durable_attempts = {c.attempt for c in live if c.durable}
    newest = max((c.step for c in live if c.verified), default=None)
    newest_durable = max((c.step for c in live if c.durable), default=None)
    by_tier = {t: _tier_keeps(live, t, rules, now, evicted.get(t, {})) for t in TIERS}
    c_out: list[CheckpointDecision] = []
    r_out: list[ReplicaDecision] = []
    for c in cks:
        if not c.replicas:
            continue
        if c.state == RETIRED:
            c_out.append(CheckpointDecision(c.run, c.step, RETIRE, "retired", c.attempt))
            r_out += [_decide(c, r, RETIRE, "retired") for r in c.replicas]
            continue
        if c.state == SUPERSEDED:
            c_out.append(d := _superseded(c, durable_attempts, rules))
            r_out += [_decide(c, r, d.action, d.reason) for r in c.replicas]
            continue
        holds = _holds(c, newest, newest_durable)
        parent = [f"parent of {r}" for r in c.children] if rules.keep_parents else []
        # the run's newest durable checkpoint, while a newer verified one is not durable yet, is
        # what a lost node resumes from: kept (on its most durable tier) whatever the policies say
        if c.step == newest_durable and newest is not None and newest > newest_durable:
            parent.insert(0, "newest durable")
        locks = sorted({r.locked_until for r in c.replicas if r.locked_until is not None and r.locked_until > now})
        lock = [f"locked until {locks[-1].isoformat()}"] if locks else []
        tier_reasons = {t: by_tier[t].get(c.step, []) for t in TIERS if c.on(t)}
        why_kept = holds + parent + lock + [f"tier {t} {r}" for t, rs in tier_reasons.items() for r in rs]
        over = [evicted[t][(c.run, c.step)] for t in TIERS if (c.run, c.step) in evicted.get(t, {})]
        if not why_kept:
            gone = over[0] if over else "no tier keeps it"
            c_out.append(CheckpointDecision(c.run, c.step, RETIRE, gone, c.attempt))
            r_out += [_decide(c, r, RETIRE, gone) for r in c.replicas]
            continue
        c_out.append(CheckpointDecision(c.run, c.step, KEEP, ", ".join(why_kept), c.attempt))
        parent_tier = max((t for t in tier_reasons if c.complete(t)), default=max(tier_reasons))
        archive = rules.tier2_on and is_milestone(c.kind, c.step, c.tags, rules.milestones)
        staying = set(c.replicas)
        for t in TIERS:
            reasons = holds + tier_reasons.get(t, [])
            if parent and t == parent_tier:
                reasons = reasons + parent
            for r in sorted((r for r in c.replicas if r.tier == t), key=lambda r: r.part):
                mine = reasons + (lock if r.locked_until is not None and r.locked_until > now else [])
                if mine:
                    r_out.append(_decide(c, r, KEEP, ", ".join(mine)))
                elif t.object_store and archive:
                    # a milestone's archive stays while another tier keeps the checkpoint: demoted
                    # on the strength of Tier 1, it would be "not yet archived" there and uploaded
                    # again, round after round; once no tier keeps it, the checkpoint is retired
                    r_out.append(_decide(c, r, KEEP, "archive of a milestone another tier keeps"))
                elif any(o is not r and o.part == r.part and o.tier != t and Tier(o.tier).as_durable_as(t)
                         for o in staying):
                    staying.discard(r)
                    why = evicted.get(t, {}).get((c.run, c.step), f"not kept on tier {t}")
                    r_out.append(_decide(c, r, DEMOTE, why))
                else:
                    r_out.append(_decide(c, r, KEEP, "last durable copy" if t.durable else "not yet durable"))
    return c_out, r_out


def _superseded(c: CheckpointFacts, durable_attempts: set[str], rules: Rules) -> CheckpointDecision:
    """An older attempt's checkpoint above where a newer attempt resumed: history that nothing
    resumes from. Retired once the newer attempt has a durable checkpoint (until then it is what
    an operator could still go back to); a pin, an alias or a child run holds it as ever."""
    by = c.superseded_by or ""
    holds = (["pinned"] if c.pinned else []) + [f"alias {a}" for a in c.aliases]
    holds += [f"parent of {r}" for r in c.children] if rules.keep_parents else []
    if holds:
        return CheckpointDecision(c.run, c.step, KEEP, ", ".join(holds), c.attempt)
    if by not in durable_attempts:
        return CheckpointDecision(c.run, c.step, KEEP, f"superseded by attempt {by or '(unnamed)'}, which has no "
                                  "durable checkpoint yet", c.attempt)
    return CheckpointDecision(c.run, c.step, RETIRE, f"superseded by attempt {by or '(unnamed)'}", c.attempt)


def _holds(c: CheckpointFacts, newest: int | None, newest_durable: int | None) -> list[str]:
    """What keeps a checkpoint on every tier that holds it."""
    out = ["pinned"] if c.pinned else []
    out += [f"alias {a}" for a in c.aliases]
    if c.step == newest:
        out.append("newest verified")
    if newest_durable is None or c.step > newest_durable:
        out.append("newer than newest durable")
    return out


def _tier_keeps(live: Sequence[CheckpointFacts], tier: int, rules: Rules, now: datetime,
                evicted: Mapping[tuple[str, int], str]) -> dict[int, list[str]]:
    """step -> the rules of ``tier``'s policy that keep it there (empty: none); ``evicted``: the
    checkpoints the tier's budget no longer keeps as ``retention off``."""
    policy = rules.policies.get(tier) or RetentionPolicy(enabled=False)
    held = sorted((c for c in live if c.on(tier)), key=lambda c: c.step, reverse=True)
    keeps: dict[int, list[str]] = {c.step: [] for c in held}
    if not policy.enabled:
        for c in held:
            if (c.run, c.step) not in evicted:
                keeps[c.step].append("retention off")
        if policy.max_bytes is None:
            return keeps
        # under a budget, what is not yet durable and a kept milestone are named: such a copy is
        # kept by a rule, never only as "retention off", so the budget never takes it
    else:
        _policy_keeps(held, policy, now, keeps)
    for c in held:
        if Tier(tier).node_local and not c.durable:
            keeps[c.step].append("not yet durable")
        elif Tier(tier).shared_fs and policy.keep_milestones and is_milestone(c.kind, c.step, c.tags, rules.milestones):
            # Tier 1 holds a milestone until Tier 2 has it (the archive reads Tier 1), or for good
            # as the archive; Tier 0 is scratch: its copy goes once the checkpoint is durable
            if rules.tier2_on and not c.complete(Tier.OBJECT):
                keeps[c.step].append("milestone not yet archived")
            elif not rules.tier2_on:
                keeps[c.step].append("milestone")
    return keeps


def _policy_keeps(held: Sequence[CheckpointFacts], policy: RetentionPolicy, now: datetime,
                  keeps: dict[int, list[str]]) -> None:
    """Add to ``keeps`` what the policy's own rules keep of ``held`` (newest first)."""
    for c in held[: policy.keep_last or 0]:
        keeps[c.step].append("keep_last")
    metric = policy.metric
    if policy.top_k and metric:
        # a non-finite value (a diverged run's NaN, an overflow's inf) ranks nowhere: it never
        # makes a checkpoint best, and never pushes a finite one out of the top k
        scored = [c for c in held if math.isfinite(c.metrics.get(metric, math.nan))]
        scored.sort(key=lambda c: c.metrics[metric], reverse=policy.metric_mode == "max")
        for c in scored[: policy.top_k]:
            keeps[c.step].append(f"top_k {metric}")
    if policy.max_age_days:
        cutoff = now - timedelta(days=policy.max_age_days)
        # the age runs from the later of the writer's stamp and the catalog's commit time: a
        # writer whose clock lags must not see its fresh checkpoint go
        for c in held:
            if c.created_at >= cutoff or (c.committed_at is not None and c.committed_at >= cutoff):
                keeps[c.step].append("max_age")


def _decide(c: CheckpointFacts, r: ReplicaFacts, action: str, reason: str) -> ReplicaDecision:
    return ReplicaDecision(run=c.run, step=c.step, tier=r.tier, part=r.part, replica_id=r.replica_id, node=r.node,
                           url=r.url, bytes=r.bytes, action=action, reason=reason, attempt=c.attempt,
                           contents=r.contents)
