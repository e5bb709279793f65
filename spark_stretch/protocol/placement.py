"""Where a key's state lives: key -> 64-bit hash -> bucket -> instance. One policy for every runtime.

A runtime turns a key into a 64-bit value in its own way (the engine: the key's exact int64, a
string's interned id; the ``applyInPandasWithState`` drop-in: a SipHash of the key columns).
From there on the rule is this module's, everywhere:

- **bucket**: ``((mix64(h) >> 32) * B) >> 32`` of ``B`` buckets (splitmix64's finaliser, then a
  multiply-shift range reduction: no modulo bias, and every window of a key in one bucket);
- **instance**: the *owner map*, one owner per bucket; :func:`balanced_owner_map` gives each of
  ``m`` instances a contiguous, equal range. Rescaling or rebalancing changes the owner map only:
  no state moves (an epoch switch).

Hosts are the next level (a key group of buckets per host); they will extend this module, not
add a second scheme. The engine's numba kernels (``engine/kernels.py``: ``mix64``,
``bucket_of``) compute the same function inside their loops; a test holds the two equal.

Examples
--------
>>> import numpy as np
>>> from spark_stretch.protocol.placement import balanced_owner_map, bucket_of
>>> bucket_of(np.array([0, 1, 2, 3], np.int64), 8).tolist()
[7, 4, 4, 0]
>>> balanced_owner_map(8, range(2)).tolist()
[0, 0, 0, 0, 1, 1, 1, 1]
"""

from __future__ import annotations

import numpy as np

__all__ = ["PlacementError", "mix64", "bucket_of", "balanced_owner_map", "validate_owner_map",
           "moved_buckets"]

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class PlacementError(ValueError):
    """An owner map that does not place every bucket on an active instance."""


def mix64(keys) -> np.ndarray:
    """splitmix64's finaliser of each 64-bit key (int64 or uint64), as uint64."""
    z = np.asarray(keys).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLD
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def bucket_of(keys, n_buckets: int) -> np.ndarray:
    """The bucket of each key, of ``n_buckets`` (int64)."""
    h = mix64(keys) >> np.uint64(32)
    with np.errstate(over="ignore"):
        return ((h * np.uint64(n_buckets)) >> np.uint64(32)).astype(np.int64)


def balanced_owner_map(n_buckets: int, instances) -> np.ndarray:
    """Owner map giving each instance an equal contiguous range of buckets.

    Contiguous ranges keep the per-bucket counters an instance writes on its own cache lines.

    Examples
    --------
    >>> balanced_owner_map(4, [0, 2]).tolist()
    [0, 0, 2, 2]
    """
    inst = np.asarray(sorted(instances), np.int64)
    if inst.size == 0:
        raise PlacementError("instances is empty; an owner map needs at least one instance")
    return inst[(np.arange(n_buckets) * inst.size) // n_buckets]


def validate_owner_map(owner_map, n_buckets: int, instances) -> np.ndarray:
    """``owner_map`` as int64 if it gives each of ``n_buckets`` buckets an owner among
    ``instances`` (else :class:`PlacementError`, naming the first bucket without one)."""
    om = np.asarray(owner_map)
    if om.ndim != 1 or om.shape[0] != n_buckets:
        raise PlacementError(f"owner_map has shape {om.shape}; it must give an owner to each of the "
                             f"B={n_buckets} buckets (length {n_buckets})")
    if not np.issubdtype(om.dtype, np.integer):
        raise PlacementError(f"owner_map has dtype {om.dtype}; it must be an integer array of "
                             "instance ids")
    bad = ~np.isin(om, np.asarray(list(instances), np.int64))
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise PlacementError(f"owner_map misses bucket {b}: its owner {int(om[b])} is not one of "
                             f"the active instances {sorted(instances)} ({int(bad.sum())} buckets "
                             "have no valid owner)")
    return om.astype(np.int64)


def moved_buckets(before: np.ndarray, after: np.ndarray) -> int:
    """How many buckets change owner between two owner maps."""
    return int((np.asarray(before) != np.asarray(after)).sum())
