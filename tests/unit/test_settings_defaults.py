"""The tier roots and the catalog URL are always set once settings load: unset, empty or None
each mean the default under ``data_dir`` (the code relies on a ``str`` there)."""

import pytest

from core.settings import Settings


@pytest.mark.parametrize("unset", [None, ""])
def test_unset_tier_roots_and_catalog_take_the_data_dir_defaults(tmp_path, unset):
    s = Settings(data_dir=tmp_path, node="n1", tier0_url=unset, tier1_url=unset, catalog_url=unset)
    assert s.tier0_url == str(tmp_path.absolute() / "tier0" / "n1")
    assert s.tier1_url == str(tmp_path.absolute() / "tier1")
    assert s.catalog_url == f"sqlite:///{tmp_path.absolute() / 'catalog.db'}"


def test_given_values_are_kept(tmp_path):
    s = Settings(data_dir=tmp_path, tier0_url="/nvme", tier1_url="/lustre", catalog_url="sqlite:///x.db")
    assert (s.tier0_url, s.tier1_url, s.catalog_url) == ("/nvme", "/lustre", "sqlite:///x.db")
