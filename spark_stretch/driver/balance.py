"""Spreading measured load: buckets over a host's instances, key groups over a query's hosts.

One greedy heuristic for both, Elasticutor's (elasticutor.txt, §4: shards move one at a time
from the most loaded executor to the least loaded one, each time the shard that best evens the
two, until the most loaded carries at most theta times the mean): :func:`spread` moves items
(buckets, key groups) between parts (instances, hosts) by their measured loads, and
:func:`rebalanced` is it for a host's buckets. An item costs each part ``cost[part]`` work per
unit of load (1: the load itself), so a host that does less work per key (another CPU, more
instances free) can be filled further.

Examples
--------
>>> from spark_stretch.driver.balance import rebalanced, spread
>>> spread([5, 1, 1, 1], [0, 0, 1, 1], [0, 1], done=lambda work, top: False).tolist()
[0, 1, 1, 1]
>>> rebalanced([5, 1, 1, 1], [0, 0, 1, 1], [0, 1], 1.2).tolist()
[0, 1, 1, 1]
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import numpy as np

__all__ = ["rebalanced", "spread"]


def spread(load, owner, parts: Sequence[int], done: Callable[[Dict[int, float], int], bool],
           cost: Optional[Dict[int, float]] = None) -> Optional[np.ndarray]:
    """A new owner of each item: items moved one at a time from the busiest part to the least
    busy one, each time the item that leaves the busier of the two least busy (with equal
    costs, the item whose load is closest to half the gap: Elasticutor's choice), until
    ``done(work, busiest)`` (``work``: each part's work) or no move lowers the busiest part's
    work. None if nothing moved.

    Parameters
    ----------
    load : sequence of float
        Each item's measured load.
    owner : sequence of int
        Each item's part now.
    parts : sequence of int
        The parts that may own items (each may receive some).
    done : callable
        ``done(work, busiest)``: whether to stop, given each part's work and the busiest part.
    cost : dict, optional
        The work one unit of load makes on each part (1 for every part).

    Examples
    --------
    >>> spread([4, 3, 2, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 1],
    ...        done=lambda w, top: False).tolist()   # (evened out: 5 and 5)
    [1, 0, 0, 1, 1, 1]
    >>> spread([10, 0], [0, 1], [0, 1], done=lambda w, top: False) is None  # (no move helps)
    True
    """
    w = np.asarray(load, np.float64)
    om = np.array(owner, np.int64)
    parts = sorted(int(p) for p in parts)
    cost = {p: 1.0 for p in parts} if cost is None else {p: float(cost[p]) for p in parts}
    if len(parts) < 2 or w.sum() <= 0:
        return None
    work = {p: cost[p] * float(w[om == p].sum()) for p in parts}
    moved = False
    for _ in range(len(w)):
        h = max(work, key=work.get)
        lo = min(work, key=work.get)
        if h == lo or done(work, h):
            break
        cand = np.flatnonzero((om == h) & (w > 0))
        after = np.maximum(work[h] - w[cand] * cost[h], work[lo] + w[cand] * cost[lo])
        if not len(cand) or after.min() >= work[h] * (1 - 1e-12):
            break
        g = int(cand[np.argmin(after)])
        om[g] = lo
        work[h] -= w[g] * cost[h]
        work[lo] += w[g] * cost[lo]
        moved = True
    return om if moved else None


def rebalanced(bucket_load, owner_map, instances, theta: float) -> Optional[np.ndarray]:
    """A new owner map: buckets moved one at a time from the busiest instance to the least
    loaded one, each time the bucket that lowers the busier of the two the most (Elasticutor's
    heuristic), until the busiest instance carries at most ``theta`` times the mean or no move
    helps. None if nothing moved.

    Examples
    --------
    >>> rebalanced([5, 1, 1, 1], [0, 0, 1, 1], [0, 1], 1.2).tolist()
    [0, 1, 1, 1]
    """
    inst = list(instances)
    mean = float(np.sum(np.asarray(bucket_load, np.float64))) / max(len(inst), 1)
    return spread(bucket_load, owner_map, inst, lambda work, h: work[h] <= theta * mean)
