"""Names shared by the deployments and their callers (``ckpt promote`` without ``--here``, the
agent that starts a checkpoint's promote run).

A Prefect deployment is addressed as ``<flow name>/<deployment name>``. The flow names are
fixed in ``flows/``; each training node serves its own promote deployment, named after the
node, so that the Tier 0 -> Tier 1 copy runs where the Tier 0 bytes are.
"""

from __future__ import annotations

PROMOTE_FLOW = "promote-checkpoint"
ARCHIVE_FLOW = "archive-checkpoint"
RETENTION_FLOW = "enforce-retention"
RECONCILE_FLOW = "reconcile"  # no deployment: the agent runs it (deployments/reconcile_loop.py)
SCRUB_FLOW = "scrub"
DRILL_FLOW = "restore-drill"

PROMOTE_DEPLOYMENT = PROMOTE_FLOW + "/{node}"

NODE_POLL_S = 30.0  # how often a node's agent (``--node-only``) polls for runs, unless the environment says


def promote_deployment(node: str) -> str:
    """The full name of ``node``'s promote deployment, e.g. ``promote-checkpoint/gpu-node-07``."""
    return PROMOTE_DEPLOYMENT.format(node=node)

# Deployment names (the part after the flow name). Node-scoped ones are named after the node.
CLUSTER = "cluster"  # archive, retention, scrub, drill: served once per cluster (the agent without --node-only)
ARCHIVE_DEPLOYMENT = ARCHIVE_FLOW + "/" + CLUSTER
RETENTION_DEPLOYMENT = RETENTION_FLOW + "/" + CLUSTER
SCRUB_DEPLOYMENT = SCRUB_FLOW + "/" + CLUSTER  # on Settings.scrub_cron
DRILL_DEPLOYMENT = DRILL_FLOW + "/" + CLUSTER  # on Settings.drill_cron

# Trigger template of the archive deployment: the event's payload, passed through raw (the
# flow validates). Every key has a default: Prefect silently drops a triggered run whose
# template references a missing key, and a malformed event must give a *failed* run instead.
ARCHIVE_PARAMETERS = {
    "run": "{{ event.payload.run | default('') }}",
    "step": "{{ event.payload.step | default('') }}",
}
