"""Quality tiers (``common.quality``): a tier names a family's step cache threshold."""

from __future__ import annotations

import pytest

from common.quality import QUALITIES, TIERS, tier_threshold


def test_exact_is_no_cache_for_every_family():
    assert QUALITIES[0] == "exact"
    assert tier_threshold("kiln-tiny", "exact") is None
    assert tier_threshold("wan", "exact") is None


def test_a_family_s_tiers_cache_more_as_they_get_faster():
    assert 0 < tier_threshold("kiln-tiny", "balanced") < tier_threshold("kiln-tiny", "fast")
    assert set(TIERS["kiln-tiny"]) == set(QUALITIES) - {"exact"}


def test_a_family_without_measured_thresholds_and_an_unknown_tier_are_refused():
    with pytest.raises(ValueError, match="exact only"):
        tier_threshold("wan", "fast")
    with pytest.raises(ValueError, match="quality must be one of"):
        tier_threshold("kiln-tiny", "draft")
