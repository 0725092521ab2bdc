"""Names shared by the deployments and their callers (``ckpt promote`` without ``--here``).

A Prefect deployment is addressed as ``<flow name>/<deployment name>``. The flow names are
fixed in ``flows/``; each training node serves its own promote deployment, named after the
node, so that the Tier 0 -> Tier 1 copy runs where the Tier 0 bytes are.
"""

from __future__ import annotations

PROMOTE_FLOW = "promote-checkpoint"
ARCHIVE_FLOW = "archive-checkpoint"
RETENTION_FLOW = "enforce-retention"
RECONCILE_FLOW = "reconcile"

PROMOTE_DEPLOYMENT = PROMOTE_FLOW + "/{node}"


def promote_deployment(node: str) -> str:
    """The full name of ``node``'s promote deployment, e.g. ``promote-checkpoint/gpu-node-07``."""
    return PROMOTE_DEPLOYMENT.format(node=node)
