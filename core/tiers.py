"""The three storage tiers and what each one is, in one place.

The catalog stores a tier as its number (0, 1, 2); code that asks what a tier *is* asks this
type instead of comparing numbers, so that "node-local", "as durable as" and "object store" are
written once: retention's rule, the catalog's prune guard and the tasks all read them here.
"""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """A storage tier; an int, so it goes into catalog columns and settings as its number."""

    NODE = 0  # node-local NVMe scratch, written by the training job
    SHARED = 1  # the cluster's shared parallel file system
    OBJECT = 2  # S3-compatible object storage, the durable vault

    @property
    def node_local(self) -> bool:
        """Only the node that wrote it can read it, and it is lost with that node."""
        return self is Tier.NODE

    @property
    def shared_fs(self) -> bool:
        """A file system every node mounts (its files can be read in place)."""
        return self is Tier.SHARED

    @property
    def object_store(self) -> bool:
        """Objects behind an API: read by download, never in place; written whole."""
        return self is Tier.OBJECT

    @property
    def durability(self) -> int:
        """Durability rank for the prune guard: a node-local copy is lost with its node; the
        shared tiers survive the loss of any node and stand in for each other, so a copy may
        go only while a verified copy of equal or higher rank exists on another tier."""
        return 0 if self.node_local else 1

    @property
    def durable(self) -> bool:
        """Survives the loss of any node (a checkpoint complete here is safe to rotate from)."""
        return self.durability >= 1

    def as_durable_as(self, other: int) -> bool:
        """A copy here may stand in for one on ``other`` (the prune guard's question)."""
        return self.durability >= Tier(other).durability

    @property
    def short(self) -> str:
        """The tier's one-word name in machine-read output (``--json``)."""
        return _SHORT[self]

    @property
    def display(self) -> str:
        """The tier as users read it in tables and messages."""
        return f"Tier {self.value} ({_KIND[self]})"


_SHORT = {Tier.NODE: "nvme", Tier.SHARED: "pfs", Tier.OBJECT: "object"}
_KIND = {Tier.NODE: "node NVMe", Tier.SHARED: "shared FS", Tier.OBJECT: "object store"}

ALL_TIERS: tuple[Tier, ...] = tuple(Tier)
DURABLE_TIERS: tuple[Tier, ...] = tuple(t for t in Tier if t.durable)


def readable_from(tier: int, copy_node: str | None, node: str | None) -> bool:
    """A copy on ``tier`` recorded on ``copy_node`` can be read on ``node``: a shared tier's
    from any node, a node-local one only on its own node (none recorded: the single-node case)."""
    return not Tier(tier).node_local or copy_node in (None, "", node)
