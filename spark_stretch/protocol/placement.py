"""Where a key's state lives: key -> 64-bit hash -> bucket -> instance. One policy for every runtime.

A runtime turns a key into a 64-bit value in its own way (the engine: the key's exact int64, a
string's interned id; the ``applyInPandasWithState`` drop-in: a SipHash of the key columns).
From there on the rule is this module's, everywhere:

- **bucket**: ``((mix64(h) >> 32) * B) >> 32`` of ``B`` buckets (splitmix64's finaliser, then a
  multiply-shift range reduction: no modulo bias, and every window of a key in one bucket);
- **instance**: the *owner map*, one owner per bucket; :func:`balanced_owner_map` gives each of
  ``m`` instances a contiguous, equal range. Rescaling or rebalancing changes the owner map only:
  no state moves (an epoch switch).

Across hosts, one level up: a query's key space is split into ``G`` **key groups** (a fixed
number per query, kept in its checkpoint, like Flink's max parallelism): a key's group is
Spark's ``pmod(xxhash64(key), G)`` (``xxhash64`` with Spark's seed 42, over the key's UTF-8 or
binary bytes, or its value as a long), so the JVM routing rows and every host's engine agree
without sharing any dictionary. The **host map** gives each group the host that owns it
(:func:`balanced_host_map`, :func:`host_map_of_counts`); inside a host, a group's keys live in
buckets owned by instances as above. Moving groups between hosts changes the host map and moves
the state of those groups only.
The drop-in's rows on several hosts carry their bucket as computed by Spark, in the column
:data:`BUCKET` (``pmod(xxhash64(k1, ...), B)``, ``driver/routing.py``), its key group the
bucket's ``pmod(bucket, G)``.

The engine's numba kernels (``engine/buckets.py``: ``mix64``, ``bucket_of``;
``engine/hashing.py``: ``xxhash64``) compute the same functions inside their loops; tests hold
them equal (and ``xxhash64`` equal to Spark's own).

Examples
--------
>>> import numpy as np
>>> from spark_stretch.protocol.placement import balanced_owner_map, bucket_of
>>> bucket_of(np.array([0, 1, 2, 3], np.int64), 8).tolist()
[7, 4, 4, 0]
>>> balanced_owner_map(8, range(2)).tolist()
[0, 0, 0, 0, 1, 1, 1, 1]
>>> balanced_host_map(6, 2).tolist()
[0, 0, 0, 1, 1, 1]
>>> key_group(np.array([-7, 7], np.int64), 4).tolist()
[1, 3]
"""

from __future__ import annotations

import numpy as np

__all__ = ["PlacementError", "mix64", "bucket_of", "balanced_owner_map", "validate_owner_map",
           "moved_buckets", "XXHASH_SEED", "key_group", "balanced_host_map", "host_map_of_counts",
           "validate_host_map", "BUCKET"]

BUCKET = "__stretch_bucket"  # (a routed row's bucket, computed by Spark: the drop-in's)

XXHASH_SEED = 42  # Spark's xxhash64 seed (org.apache.spark.sql.catalyst.expressions.XxHash64)

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


def key_group(hashes, n_groups: int) -> np.ndarray:
    """The key group of keys whose Spark ``xxhash64`` values are ``hashes``: Spark's
    ``pmod(hash, n_groups)`` (int64, in ``0 .. n_groups - 1``)."""
    return np.mod(np.asarray(hashes, np.int64), np.int64(n_groups))


def balanced_host_map(n_groups: int, n_hosts: int) -> np.ndarray:
    """Host map giving each of ``n_hosts`` hosts an equal contiguous range of the ``n_groups``
    key groups."""
    if n_hosts < 1 or n_groups < n_hosts:
        raise PlacementError(f"{n_groups} key groups cannot be spread over {n_hosts} hosts "
                             "(spark.stretch.keyGroups must be at least the number of hosts)")
    return (np.arange(n_groups) * n_hosts) // n_groups


def host_map_of_counts(counts, n_groups: int, before=None) -> np.ndarray:
    """A host map where host ``i`` owns ``counts[i]`` key groups (they must add up to
    ``n_groups``), moving as few groups as it can from ``before`` (a host map, or None: a
    contiguous range each).

    Examples
    --------
    >>> host_map_of_counts([4, 0], 4, before=[0, 0, 1, 1]).tolist()
    [0, 0, 0, 0]
    >>> host_map_of_counts([2, 2], 4, before=[0, 0, 0, 0]).tolist()
    [0, 0, 1, 1]
    """
    counts = [int(c) for c in counts]
    if any(c < 0 for c in counts) or sum(counts) != n_groups:
        raise PlacementError(f"key group counts {counts} must be non-negative and add up to the "
                             f"query's {n_groups} key groups")
    if before is None:
        return np.repeat(np.arange(len(counts)), counts).astype(np.int64)
    hm = np.asarray(before, np.int64).copy()
    kept, spare = {}, []  # each host keeps its first groups up to its count; the rest move
    for h in np.unique(hm).tolist():
        mine = np.flatnonzero(hm == h)
        want = counts[h] if h < len(counts) else 0
        kept[h] = min(want, len(mine))
        spare.extend(mine[want:].tolist())
    for h, want in enumerate(counts):
        for _ in range(want - kept.get(h, 0)):
            hm[spare.pop()] = h
    return hm


def validate_host_map(host_map, n_groups: int, n_hosts: int) -> np.ndarray:
    """``host_map`` as int64 if it gives each of ``n_groups`` key groups a host in
    ``0 .. n_hosts - 1`` (else :class:`PlacementError` naming the first group without one)."""
    hm = np.asarray(host_map)
    if hm.ndim != 1 or hm.shape[0] != n_groups or not np.issubdtype(hm.dtype, np.integer):
        raise PlacementError(f"a host map gives a host to each of the {n_groups} key groups; got "
                             f"shape {hm.shape}, dtype {hm.dtype}")
    bad = (hm < 0) | (hm >= n_hosts)
    if bad.any():
        g = int(np.flatnonzero(bad)[0])
        raise PlacementError(f"key group {g} has host {int(hm[g])}, not one of the query's "
                             f"{n_hosts} hosts")
    return hm.astype(np.int64)
