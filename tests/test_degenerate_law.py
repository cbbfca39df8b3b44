"""dp's law and prices on degenerate input (issue 9's bar): a fresh law, a zero-byte state, empty and overflowing
histograms, bad law settings, none of them a ZeroDivisionError, IndexError or NaN."""

import math

import numpy as np
import pytest

from prefixlab.cache.law import EntryLaw
from prefixlab.cache.placement import OverlapHistogram, PlacementTable
from prefixlab.errors import InvalidInputError


def test_a_fresh_law_prices_a_zero_token_state_without_dividing_by_zero():
    """calibration(0) on a law that predicted nothing was 0 / 0 (a state of 0 bytes, or of under a KV token's)."""
    law = EntryLaw(1 << 15, 32, 0.999, 64)
    assert law.calibration(0.0) == 1.0 and law.calibration(5.0) == 1.0
    assert (law.pressure, law.bound(100), law.repeat_rate, law.interior_mass(0, 5)) == (0.0, 0.0, 0.0, 0.0)
    assert law.best_from_end(0) == (0, 0.0) and law.table() is None


LAW = (1 << 15, 32, 0.99, 64)  # max_len, block, decay, resolve_every


@pytest.mark.parametrize(("index", "value", "match"), [(1, 0, "block"), (3, 0, "resolve_every"), (0, -5, "max_len"),
                                                       (2, 0.0, "decay"), (2, float("nan"), "decay"),
                                                       (2, 1.5, "decay"), (2, True, "decay")])
def test_a_law_refuses_settings_that_divide_by_zero_or_make_nan_counts(index, value, match):
    args = list(LAW)
    args[index] = value
    with pytest.raises(InvalidInputError, match=match):
        EntryLaw(*args)
    if match == "decay":  # (one check for both decayed histograms)
        with pytest.raises(InvalidInputError, match=match):
            OverlapHistogram(100, decay=args[2])


def test_a_placement_table_whose_total_overflows_is_refused():
    """(Its costs were NaN: the solved curve times an infinite total.)"""
    with pytest.raises(InvalidInputError, match="overflow"):
        PlacementTable(np.array([1e308, 1e308]), 4)
    table = PlacementTable(np.array([1e300, 1e300]), 4)
    assert all(math.isfinite(table.cost(m, 2)) for m in range(table.layers + 1))


def test_a_placement_table_names_a_budget_beyond_its_layers():
    """(cost(1, j) of a one-bin histogram, which has no layer to place in, was an IndexError.)"""
    table = PlacementTable(np.array([1.0]), 4)
    assert table.layers == 0 and table.cost(0, 1) == 0.0
    with pytest.raises(InvalidInputError, match="layers"):
        table.cost(1, 1)
