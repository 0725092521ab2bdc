"""What each tier is: the one place retention, the prune guard and the tasks ask it."""

from __future__ import annotations

import pytest

from core.tiers import ALL_TIERS, DURABLE_TIERS, Tier, readable_from


def test_only_the_shared_tiers_are_durable_and_they_stand_in_for_each_other():
    assert DURABLE_TIERS == (Tier.SHARED, Tier.OBJECT)
    assert Tier.SHARED.as_durable_as(Tier.OBJECT) and Tier.OBJECT.as_durable_as(Tier.SHARED)
    assert Tier.SHARED.as_durable_as(Tier.NODE)
    assert not Tier.NODE.as_durable_as(Tier.SHARED)  # a node's NVMe never protects a shared copy


def test_a_tier_is_its_catalog_number():
    assert ALL_TIERS == (0, 1, 2) and [Tier(n) for n in (0, 1, 2)] == list(Tier)
    assert f"tier {Tier.OBJECT}" == "tier 2"  # messages and event ids read as before
    with pytest.raises(ValueError):
        Tier(3)


def test_what_each_tier_is():
    assert [(t.node_local, t.shared_fs, t.object_store) for t in Tier] == [
        (True, False, False), (False, True, False), (False, False, True)]
    assert [t.display for t in Tier] == ["Tier 0 (node NVMe)", "Tier 1 (shared FS)", "Tier 2 (object store)"]


@pytest.mark.parametrize(("tier", "copy_node", "node", "readable"), [
    (0, "n0", "n0", True), (0, "n1", "n0", False), (0, None, "n0", True), (0, "", "n0", True),
    (1, "n1", "n0", True), (2, None, "n0", True)])
def test_a_node_reads_shared_copies_and_only_its_own_nvme(tier, copy_node, node, readable):
    assert readable_from(tier, copy_node, node) is readable
