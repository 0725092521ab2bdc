"""enforce_retention: plan what each tier's policy lets go, show the plan, apply it through
the guarded prune. Runs on a schedule and after every checkpoint that became durable. The
scheduled run (all runs, not a dry run) also expires old audit entries (``tasks.audit``) and
deletes the shared Tier 2 contents no replica references (``tasks.contents``). A tier whose rules
keep more than its byte budget is a line of the plan, named in the artifact's description
(``over budget: tier 1``), and announced as ``ckpt.tier.over_budget`` when applied.

The plan is ``core.retention``'s: each replica demoted or retired with the rule that decided it
(``reason``). A dry run only plans. Applying demotes Tier 0 (of this node) first, then Tier 1,
then Tier 2, then retires (recorded first, then every copy deleted, tier by tier);
``PruneRefused`` is a normal outcome (the catalog found a reason to keep the copy) and is
reported on the plan, as is any other failure; the flow itself completes. A copy another run
beside this one pruned first is ``done by another``, never a failure.
"""

from __future__ import annotations

from prefect import flow

from core.events import announcing
from core.settings import Settings, load_settings
from flows.artifacts import artifact_batch, artifact_key, publish_table
from flows.common import Steps, current_actor, task_steps
from tasks.audit import expire_audit_task
from tasks.contents import sweep_shared_contents_task
from tasks.prefect_events import emit
from tasks.retention import OVER_BUDGET, PruneAction, apply_retention


def run_retention(settings: Settings, *, run: str | None = None, dry_run: bool = False, steps: Steps,
              actor: str = "cli", explain: bool = False) -> list[PruneAction]:
    """Plan and (unless ``dry_run``) apply it; returns the actions with outcomes. Artifacts: a
    dry run's plan; the result (each planned action with its outcome), or the plan when applying
    it failed: the same table as ``ckpt retention --dry-run`` (with ``explain``, also each kept
    copy and what keeps it). A run's retention after each durable checkpoint that found nothing
    to do publishes nothing (the scheduled, catalog-wide run always does)."""
    plan = steps.plan_retention(settings, run=run, explain=explain)
    over = [f"tier {a.tier}" + (f" on {a.node}" if a.node else "") for a in plan if a.action == OVER_BUDGET]
    scope = run or "all runs"
    alert = f"; over budget: {', '.join(over)}" if over else ""

    def show_plan(why: str) -> None:
        publish_table(artifact_key("retention-plan", run or "all"), [a.row() for a in plan],
                      f"retention plan for {scope}{why}{alert}")

    if dry_run:
        show_plan(" (dry run)")
        return plan
    try:
        done = apply_retention(settings, plan, prune=steps.prune, actor=actor)
    except BaseException:
        show_plan(" (applying it failed)")
        raise
    if done or run is None:
        publish_table(artifact_key("retention-result", run or "all"), [a.row() for a in done],
                      f"retention applied to {scope}{alert}")
    return done


def _run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"retention/{p.get('run') or 'all'}" + ("/dry-run" if p.get("dry_run") else "")


@flow(name="enforce-retention", flow_run_name=_run_name)
def enforce_retention(run: str | None = None, dry_run: bool = False, node: str | None = None,
                      explain: bool = False) -> list[dict]:
    """Settings read once here; the steps run as Prefect tasks; the plan is an artifact."""
    settings = load_settings(**({"node": node} if node else {}))
    with artifact_batch(), announcing(emit):
        actions = run_retention(settings, run=run, dry_run=dry_run, steps=task_steps(settings),
                            actor=current_actor("retention"), explain=explain)
    if not dry_run and run is None:  # the scheduled, catalog-wide run also applies the audit retention
        expire_audit_task(settings, actor=current_actor("retention"))
        sweep_shared_contents_task(settings, actor=current_actor("retention"))  # and frees unlinked contents
    return [a.row() for a in actions]
