"""The one placement policy: the engine's numba kernels and every runtime place keys alike."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from spark_stretch.engine import kernels as K
from spark_stretch.protocol import placement


def test_numpy_and_the_engine_kernels_place_every_key_in_the_same_bucket():
    keys = np.random.default_rng(1).integers(-2**63, 2**63 - 1, 200_000, dtype=np.int64)
    keys[:4] = [0, 1, -1, 2**63 - 1]
    for n_buckets in (1, 2, 7, 256, 4096, 65536):
        assert (placement.bucket_of(keys, n_buckets) == K.buckets_of(keys, n_buckets)).all()


def test_buckets_are_spread_evenly():
    b = placement.bucket_of(np.arange(1_000_000, dtype=np.int64), 64)
    counts = np.bincount(b, minlength=64)
    assert counts.min() > 0.95 * 1_000_000 / 64 and counts.max() < 1.05 * 1_000_000 / 64


def test_balanced_owner_maps_give_contiguous_equal_ranges_and_move_little_on_rescale():
    om = placement.balanced_owner_map(4096, range(3))
    assert np.all(np.diff(om) >= 0) and set(np.bincount(om)) <= {1365, 1366}
    # 1 -> 2 instances moves half the buckets; 2 -> 3 moves a third (ranges shift)
    assert placement.moved_buckets(placement.balanced_owner_map(8, [0]),
                                   placement.balanced_owner_map(8, [0, 1])) == 4
    with pytest.raises(placement.PlacementError, match="at least one instance"):
        placement.balanced_owner_map(8, [])


@pytest.mark.parametrize("owner_map,needle", [
    ([0, 1, 0, 5, 0, 1, 0, 1], "owner_map misses bucket 3: its owner 5"),
    ([0, 1], r"each of the B=8 buckets \(length 8\)"),
    (np.zeros(8), "integer array"),
])
def test_an_owner_map_that_leaves_a_bucket_without_an_active_owner_is_refused(owner_map, needle):
    with pytest.raises(placement.PlacementError, match=needle):
        placement.validate_owner_map(owner_map, 8, [0, 1])


def test_the_drop_in_places_key_columns_by_the_same_rule():
    from spark_stretch.host.grouped_state import siphash_buckets

    import pandas as pd

    t = pa.table({"user": ["a", "b", "a", None], "n": [1, 2, 1, 3]})
    b = siphash_buckets(t, ["user", "n"], 256)
    h = pd.util.hash_pandas_object(pd.DataFrame({"user": t["user"].to_pandas().astype(object),
                                                 "n": t["n"].to_pandas()}), index=False)
    assert b.tolist() == placement.bucket_of(h.to_numpy(), 256).tolist()
    assert b[0] == b[2] and 0 <= b.min() and b.max() < 256
