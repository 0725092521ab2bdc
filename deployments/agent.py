"""``ckpt agent``: the long-running process on each training node (Prefect ``serve``).

What one agent serves:
- node-scoped (always): ``promote-checkpoint/<node>``, with no trigger: the agent promotes each
  part of its node on its ``ckpt.checkpoint.completed`` event itself (the Tier 0 -> Tier 1 copy
  runs where the bytes are), and the part that completes a checkpoint starts the checkpoint's one
  run of this deployment (deployments/part_events.py); ``ckpt promote`` asks for one by hand;
  and, as plain code in this process rather than a deployment, reconcile every
  ``reconcile_interval_seconds`` (the safety net for events that never arrived;
  deployments/reconcile_loop.py), each pass in a watched child, which leaves a
  ``reconcile/<node>`` flow run only when a pass acted or its failures changed. A node's agent
  (``node_only``) sets up and sweeps its Tier 0 and Tier 1 only: the object store and the
  cluster-wide backlogs are the cluster agent's (``flows.reconcile.reconcile_once``).
- cluster-wide (unless ``node_only``): ``archive-checkpoint/cluster``, triggered by
  ``ckpt.checkpoint.durable`` (emitted once per checkpoint, when its last part is verified on
  Tier 1), ``enforce-retention/cluster`` on ``retention_cron``, ``scrub/cluster`` (re-read a
  share of the stored copies, repair what rotted) on ``scrub_cron`` and
  ``restore-drill/cluster`` (timed restore of the newest milestone) on ``drill_cron``. The
  archive trigger matches only durable events labelled ``ckpt.milestone = true`` (an inline
  archive that failed with Tier 2 configured), so a milestone archived inline, or a plain
  checkpoint, starts no archive run. Run
  exactly one agent without ``--node-only`` per cluster: two would scrub and drill twice.
  That agent also creates (or updates, by name) the RPO automation ``ckpt-rpo-late``
  (deployments/automations.py): a checkpoint not durable within ``rpo_seconds`` of its
  completed event raises ``ckpt.checkpoint.late``.

  The promote flow that completes a checkpoint also archives it inline (flows/promote.py),
  so the durable-triggered archive run is only the safety net for an inline archive that
  failed; ``archive_trigger=False`` serves the archive deployment for on-demand runs only,
  without that safety net (the demo on 2 cores).

Trigger templates pass the event's values through raw and the deployments do not enforce a
parameter schema: a malformed or hostile event then becomes a *failed* flow run whose message
says what was wrong (the flow validates), never a silently dropped one, and nothing is copied.

Flow runs execute in subprocesses that inherit this process's environment, so the agent's
settings (``CKPT_*``) are the flows' settings: the runs Prefect's runner starts (``serve``, at its
poll) and the checkpoints' promote runs the agent starts itself (deployments/processes.py).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from core import events
from core.errors import CkptError
from core.settings import Settings
from deployments import names
from deployments.part_events import part_events
from deployments.processes import (
    ONE_ARENA,
    ChildContext,
    agent_context,
    child_context,
    malloc_arenas,
    preload_agent,
    run_child,
    start_fork_server,
)
from deployments.reconcile_loop import reconciling

log = logging.getLogger("ckpt.agent")
# A deployment's version is its flow's (Prefect hashes the flow's source), never one inferred
# from whatever git checkout the agent was started in: no git subprocess per deployment per start.
VERSION: dict[str, Any] = {"version_type": "prefect:simple"}


def durable_trigger() -> Any:
    from prefect.events import DeploymentEventTrigger

    return DeploymentEventTrigger(
        name="archive when durable",
        description="Archive a milestone to Tier 2 once every part is on Tier 1.",
        expect={events.DURABLE},
        match={"ckpt.milestone": "true"},  # a plain checkpoint has nothing to archive: no run
        parameters=dict(names.ARCHIVE_PARAMETERS),
        within=timedelta(0),
    )


def node_deployments(settings: Settings) -> list[Any]:
    from prefect.types.entrypoint import EntrypointType

    from flows.promote import promote_checkpoint  # deferred: start-up — Prefect, SQLAlchemy

    node = settings.node
    return [
        promote_checkpoint.to_deployment(  # no trigger: the agent takes the events itself (part_events)
            name=node, enforce_parameter_schema=False,
            entrypoint_type=EntrypointType.MODULE_PATH, **VERSION, tags=["ckpt", f"node:{node}"],
            description=f"Tier 0 -> Tier 1 promotion of the parts on {node}.",
        ),
    ]


def cluster_deployments(settings: Settings, *, archive_trigger: bool = True) -> list[Any]:
    from prefect.types.entrypoint import EntrypointType

    from flows.archive import archive_checkpoint  # deferred: start-up — Prefect, SQLAlchemy
    from flows.drill import drill_flow  # deferred: start-up — Prefect, SQLAlchemy
    from flows.retention import enforce_retention  # deferred: start-up — Prefect, SQLAlchemy
    from flows.scrub import scrub_flow  # deferred: start-up — Prefect, SQLAlchemy

    return [
        archive_checkpoint.to_deployment(
            name=names.CLUSTER, triggers=[durable_trigger()] if archive_trigger else [],
            enforce_parameter_schema=False,
            entrypoint_type=EntrypointType.MODULE_PATH, **VERSION, tags=["ckpt", "cluster"],
            description="Tier 1 -> Tier 2 for milestones, once per durable checkpoint.",
        ),
        enforce_retention.to_deployment(
            name=names.CLUSTER, cron=settings.retention_cron, entrypoint_type=EntrypointType.MODULE_PATH, **VERSION,
            tags=["ckpt", "cluster"], description="Apply the retention policy on every tier.",
        ),
        # Flow defaults apply (scrub: Settings.scrub_fraction, repair on; drill: any run's newest
        # milestone, scratch under <data_dir>/drills); a run started by hand may pass others.
        scrub_flow.to_deployment(
            name=names.CLUSTER, cron=settings.scrub_cron, entrypoint_type=EntrypointType.MODULE_PATH, **VERSION,
            tags=["ckpt", "cluster"], description="Re-read a share of the stored copies; repair what rotted.",
        ),
        drill_flow.to_deployment(
            name=names.CLUSTER, cron=settings.drill_cron, entrypoint_type=EntrypointType.MODULE_PATH, **VERSION,
            tags=["ckpt", "cluster"], description="Timed restore of the newest milestone from Tier 1 and Tier 2.",
        ),
    ]


def build_deployments(settings: Settings, *, node_only: bool = False, archive_trigger: bool = True) -> list[Any]:
    deps = node_deployments(settings)
    if not node_only:
        deps += cluster_deployments(settings, archive_trigger=archive_trigger)
    return deps


def agent_environment(settings: Settings) -> dict[str, str]:
    """What the flow subprocesses must see so that their ``load_settings()`` equals ours:
    the values given on the command line are exported as ``CKPT_*``."""
    env = {"CKPT_NODE": settings.node, "CKPT_DATA_DIR": str(settings.data_dir.absolute()),
           "CKPT_TIER0_URL": settings.tier0_url, "CKPT_TIER1_URL": settings.tier1_url,
           "CKPT_CATALOG_URL": settings.catalog_url}
    optional = (("CKPT_TIER2_URL", settings.tier2_url), ("CKPT_S3_ENDPOINT_URL", settings.s3_endpoint_url),
                ("PREFECT_API_URL", settings.prefect_api_url))
    env.update({key: value for key, value in optional if value})
    return env


def rpo_alert(settings: Settings) -> tuple[int, str]:
    """The RPO automation created (or updated): a log level and a line. A failure is a warning,
    never fatal: promotions matter more than the alert about them."""
    from deployments.automations import AUTOMATION_NAME, ensure_rpo_automation  # deferred: start-up — Prefect client

    try:
        ensure_rpo_automation(settings.rpo_seconds, settings.prefect_api_url)
    except Exception as exc:  # noqa: BLE001 - see above
        return logging.WARNING, f"RPO automation not created: {type(exc).__name__}: {exc}"
    late = f"a checkpoint not durable {settings.rpo_seconds} s after its completion is late"
    return logging.INFO, f"RPO automation {AUTOMATION_NAME}: {late}"


def runner_poll(node_only: bool) -> dict[str, Any]:
    """The runner's poll of ``serve``: a node's agent (``node_only``) polls every
    ``names.NODE_POLL_S`` unless ``PREFECT_RUNNER_POLL_FREQUENCY`` is set (in the environment or
    a Prefect profile). Its runner only ever finds a promotion asked for by hand (``ckpt
    promote``, the UI's Run button): no promotion, reconcile or checkpoint run waits for that
    poll, while every poll is a request, a query and a deployment update on the server, from
    every node. The cluster's agent keeps Prefect's default (its crons and the archive trigger's
    runs)."""
    from prefect.settings import get_current_settings

    told = ("PREFECT_RUNNER_POLL_FREQUENCY" in os.environ
            or "poll_frequency" in get_current_settings().runner.model_fields_set)  # the environment, a profile
    return {"query_seconds": names.NODE_POLL_S} if node_only and not told else {}


def set_up_tiers(settings: Settings, tiers: tuple[int, ...]) -> list[tuple[int, str]]:
    """``init_tiers`` of ``tiers`` as the agent's start does them: a log level and a line per
    tier (a warning for one unavailable), or why none was set up (an old schema, a catalog down:
    the steps say so again, and are retried)."""
    from tasks.tier_roots import UNAVAILABLE, init_tiers  # deferred: start-up — SQLAlchemy

    try:
        return [(logging.WARNING if state.state == UNAVAILABLE else logging.INFO, state.line())
                for state in init_tiers(settings, actor=f"agent:{settings.node}", tiers=tiers)]
    except CkptError as exc:
        return [(logging.WARNING, f"tier roots {', '.join(map(str, tiers))} not set up: {exc}")]


def set_up_cluster(settings: Settings) -> None:
    """What the cluster's agent sets up at its start, in a child forked from the zygote, its lines
    logged here: the RPO automation (``rpo_alert``) and Tier 2's root (``set_up_tiers``). The
    clients they need (Prefect's, the S3 client: boto3 and botocore's service model) then never
    load into the agent or its zygote, nor leave their garbage in pages the two share
    (docs/benchmarks.md: the agent's memory); the children that reach Tier 2 (an archive, the
    cluster agent's reconcile passes) load the S3 client themselves. A node's agent never
    reaches Tier 2 at rest (``reconciling``'s ``cluster``). Nothing here stops the agent: what
    failed is a warning, and the agent serves."""
    try:
        _, lines = run_child(set_up_cluster_in_child, (settings, child_context()), stall_s=settings.copy_stall_seconds,
                             what="the cluster's set-up (tier 2's root, RPO automation)",
                             again="Tier 2's first use sets its root up; the next start, the automation")
    except OSError as exc:  # the zygote could not start the child
        lines = [(logging.WARNING, f"the cluster's set-up (tier 2's root, RPO automation) not run: {exc}")]
    for level, line in lines if isinstance(lines, list) else []:
        log.log(level, "%s", line)


def set_up_cluster_in_child(settings: Settings, context: ChildContext, beat: Any) -> list[tuple[int, str]]:
    with agent_context(context, beat, settings.log_level):
        lines: list[tuple[int, str]] = []
        if settings.tier2_url:
            try:
                lines += set_up_tiers(settings, (2,))
            except Exception as exc:  # noqa: BLE001 - the automation is still made; its first use sets tier 2 up
                lines.append((logging.WARNING, f"tier 2's root not set up: {type(exc).__name__}: {exc}"))
        return [*lines, rpo_alert(settings)]


def serving_line(deployments: list[Any]) -> str:
    """What the agent says once it serves (in place of Prefect's starting message, a table drawn
    by ``rich``, whose rendering and emoji table cost every agent its pages)."""
    served = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    return f"serving {served} once registered; a run by hand: prefect deployment run <flow/deployment>"


def serve_agent(settings: Settings, *, node_only: bool = False, limit: int | None = None,
                archive_trigger: bool = True) -> None:
    """Serve until interrupted (SIGINT/SIGTERM); Prefect pauses the schedules on the way out."""
    from prefect import serve
    from prefect.exceptions import TerminationSignal
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from db.session import close_connections  # deferred: start-up — SQLAlchemy

    os.environ.update(agent_environment(settings))
    for level, line in set_up_tiers(settings, (0, 1)):
        log.log(level, "%s", line)
    updates = {PREFECT_API_URL: settings.prefect_api_url} if settings.prefect_api_url else {}
    with temporary_settings(updates=updates):  # Prefect read its settings at import time
        deployments = build_deployments(settings, node_only=node_only, archive_trigger=archive_trigger)
        # The zygote is forked now, while this process still has one thread, from everything the
        # start-up imported and touched (the catalog's driver and engine) and what serving imports
        # (``preload_agent``): its children find them ready, and the pages stay one copy for both.
        preload_agent()
        close_connections()  # the agent never opens the catalog again; the zygote inherits none
        start_fork_server(settings)
        malloc_arenas(ONE_ARENA)  # after the fork: the zygote and its children keep glibc's default
        if not node_only:
            set_up_cluster(settings)
        log.info("%s", serving_line(deployments))
        with part_events(settings), reconciling(settings, cluster=not node_only):
            try:
                serve(*deployments, limit=limit, print_starting_message=False, **runner_poll(node_only))
            except (KeyboardInterrupt, TerminationSignal) as exc:
                log.info("received %s, shutting down", type(exc).__name__)
