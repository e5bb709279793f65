"""Elastic policies: a batch's figures in, a reconfiguration (or none) out.

A :class:`Policy` is asked once per micro-batch, after the batch's output is written, with the
batch's :class:`BatchMetrics`; a :class:`Decision` it returns is applied before the next batch's
step, as an epoch switch (no state moved), and recorded in ``q.metrics()["reconfigurations"]``
with its ``cause``. :class:`ElasticPolicy` is STRETCH's controller (stretch-tpds §8.4: scale out
above 90% utilization, in below 45%, to the parallelism that brings the mean utilization to
70%) with Elasticutor's rebalancing (theta = 1.2: buckets move from the busiest instance to the
least loaded one until the busiest carries at most theta times the mean).

A decision changes the parallelism and the owner map of a host engine's instances. On several
hosts the figures are the query's with each host's own in :attr:`BatchMetrics.hosts` (its
instances, its key groups and their loads); a decision then names its host (``host=``; none:
every host's instances), and a decision with ``key_groups=`` moves key groups between hosts
(their state moves with them: ``host/reshard.py``). ``decide`` may return several decisions
(a list): :class:`ElasticPolicy` scales each host's instances on its own figures, and when one
host runs hot moves key groups from it by their measured loads (:mod:`.balance`).

Examples
--------
>>> from spark_stretch.driver.policy import BatchMetrics, ElasticPolicy
>>> p = ElasticPolicy(max_parallelism=4)
>>> busy = BatchMetrics(batch=7, parallelism=1, max_parallelism=4, utilization=[1.2],
...                     tuples=5000)
>>> p.decide(busy)
Decision(cause='scale_out', parallelism=2)
>>> p.decide(BatchMetrics(batch=8, parallelism=2, max_parallelism=4, utilization=[0.2, 0.2],
...                       tuples=5000, batches_since_switch=3))
Decision(cause='scale_in', parallelism=1)
>>> ElasticPolicy(scale_in_below=0.8, target=0.7)
Traceback (most recent call last):
...
ValueError: ElasticPolicy: scale_in_below=0.8 must be below target=0.7 (and target below scale_out_above=0.9)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Optional, Sequence, Union

import numpy as np

from .balance import rebalanced, spread
from .figures import CAUSES, BatchMetrics, Decision

__all__ = ["BatchMetrics", "Decision", "Policy", "ElasticPolicy", "CAUSES", "rebalanced",
           "as_policy"]


class Policy(ABC):
    """A policy of an elastic query: ``decide`` gets each batch's :class:`BatchMetrics` (on the
    driver, between two batches) and returns a :class:`Decision`, a list of them (on several
    hosts: one per host, say) or None.

    Examples
    --------
    >>> class EveryTenth(Policy):
    ...     def decide(self, m):
    ...         if m.batch % 10 == 9 and m.parallelism < m.max_parallelism:
    ...             return Decision("scale_out", parallelism=m.parallelism + 1)
    >>> EveryTenth().decide(BatchMetrics(batch=9, parallelism=1, max_parallelism=2))
    Decision(cause='scale_out', parallelism=2)
    """

    @abstractmethod
    def decide(self, metrics: BatchMetrics) -> Union[Decision, Sequence[Decision], None]:
        """The reconfiguration(s) after this batch, or None."""

    def bind(self, max_parallelism: int) -> "Policy":
        """Check the policy against a query of ``max_parallelism`` instances (before it
        starts); the policy to run."""
        return self


def _unit(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ValueError(f"ElasticPolicy: {name}={v!r} must be a positive number")
    return float(v)


def _count(name: str, v, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ValueError(f"ElasticPolicy: {name}={v!r} must be an integer >= {least}")
    return int(v)


class ElasticPolicy(Policy):
    """STRETCH's threshold controller with Elasticutor's rebalancing.

    Parameters
    ----------
    scale_out_above : float
        Scale out when the utilization of the active instances is above this (0.9): their
        :attr:`BatchMetrics.demand`, the mean utilization the batch's input takes (the work
        the next step has), or without it their mean utilization.
    scale_in_below : float
        Scale in when it is below this (0.45).
    target : float
        The utilization a scaling aims at (0.7): the new parallelism is
        ``ceil(parallelism * utilization / target)``, at least one more (out) or fewer (in).
    min_parallelism, max_parallelism : int
        The range of parallelisms (1 and the query's ``max_parallelism``).
    cooldown_batches : int
        Batches after an epoch switch (of any cause, the user's too) with no decision (2).
    rebalance_above : float or None
        Rebalance when the busiest instance's load is above this many times the mean (1.2);
        None: never. Only ownership moves (no state).
    rebalance_hosts_above : float or None
        On several hosts: move key groups (with their state) from the host that takes the most
        keys to the least loaded ones when it takes more than this many times the mean (1.2),
        until it takes at most that; also when a host's instances all run (``max_parallelism``)
        above ``scale_out_above`` while another host's would be below ``target``: then by
        their work (each host's busy time per key). Groups are chosen by their measured keys,
        greedily (:func:`~.balance.spread`). None: never. No move within ``cooldown_batches``
        of the last one, nor after a batch with fewer keys than key groups.

    Notes
    -----
    On several hosts each host's instances are scaled and rebalanced on that host's own
    figures (a decision per host), unless key groups move after the batch.

    Examples
    --------
    >>> ElasticPolicy(min_parallelism=3, max_parallelism=2)
    Traceback (most recent call last):
    ...
    ValueError: ElasticPolicy: max_parallelism=2 is below min_parallelism=3
    >>> ElasticPolicy(cooldown_batches=-1)
    Traceback (most recent call last):
    ...
    ValueError: ElasticPolicy: cooldown_batches=-1 must be an integer >= 0
    """

    def __init__(self, scale_out_above: float = 0.9, scale_in_below: float = 0.45,
                 target: float = 0.7, min_parallelism: int = 1,
                 max_parallelism: Optional[int] = None, cooldown_batches: int = 2,
                 rebalance_above: Optional[float] = 1.2,
                 rebalance_hosts_above: Optional[float] = 1.2):
        self.scale_out_above = _unit("scale_out_above", scale_out_above)
        self.scale_in_below = _unit("scale_in_below", scale_in_below)
        self.target = _unit("target", target)
        if not self.scale_in_below < self.target < self.scale_out_above:
            raise ValueError(
                f"ElasticPolicy: scale_in_below={scale_in_below} must be below target={target} "
                f"(and target below scale_out_above={scale_out_above})")
        self.min_parallelism = _count("min_parallelism", min_parallelism, 1)
        self.max_parallelism = (None if max_parallelism is None else
                                _count("max_parallelism", max_parallelism, 1))
        if self.max_parallelism is not None and self.max_parallelism < self.min_parallelism:
            raise ValueError(f"ElasticPolicy: max_parallelism={max_parallelism} is below "
                             f"min_parallelism={min_parallelism}")
        self.cooldown_batches = _count("cooldown_batches", cooldown_batches, 0)
        for name, v, what in (("rebalance_above", rebalance_above, "instance"),
                              ("rebalance_hosts_above", rebalance_hosts_above, "host")):
            if v is not None and _unit(name, v) <= 1:
                raise ValueError(f"ElasticPolicy: {name}={v} must be above 1 (the busiest "
                                 f"{what}'s load over the mean), or None")
        self.rebalance_above = rebalance_above
        self.rebalance_hosts_above = rebalance_hosts_above

    def __repr__(self) -> str:
        return (f"ElasticPolicy(scale_out_above={self.scale_out_above}, "
                f"scale_in_below={self.scale_in_below}, target={self.target}, "
                f"min_parallelism={self.min_parallelism}, "
                f"max_parallelism={self.max_parallelism}, "
                f"cooldown_batches={self.cooldown_batches}, "
                f"rebalance_above={self.rebalance_above}, "
                f"rebalance_hosts_above={self.rebalance_hosts_above})")

    def bind(self, max_parallelism: int) -> "ElasticPolicy":
        """This policy for a query of ``max_parallelism`` instances (its own max, if given, is
        at most that): a ValueError naming the argument otherwise."""
        if self.max_parallelism is not None and self.max_parallelism > max_parallelism:
            raise ValueError(f"ElasticPolicy: max_parallelism={self.max_parallelism} is above "
                             f"the query's max_parallelism={max_parallelism} (the instances "
                             "it creates)")
        if self.min_parallelism > max_parallelism:
            raise ValueError(f"ElasticPolicy: min_parallelism={self.min_parallelism} is above "
                             f"the query's max_parallelism={max_parallelism}")
        return self

    def decide(self, m: BatchMetrics):
        if m.hosts is None:
            return self._decide_host(m)
        move = self._move_groups(m)
        if move is not None:
            return move
        out = [replace(d, host=h.host) for h in m.hosts
               if (d := self._decide_host(h)) is not None]
        return out or None

    def _decide_host(self, m: BatchMetrics) -> Optional[Decision]:
        """The decision for one host's instances (a query on one host: its instances)."""
        since = m.batches_since_switch
        if since is not None and since <= self.cooldown_batches:
            return None
        if not m.utilization or (m.demand is None and not m.tuples):
            return None  # (nothing measured: the step processed no tuple)
        top = self._top(m)
        cur = m.parallelism
        u = _used(m)
        want = math.ceil(cur * u / self.target - 1e-9)
        if u > self.scale_out_above and cur < top:
            return Decision("scale_out", parallelism=min(top, max(cur + 1, want)))
        if u < self.scale_in_below and cur > self.min_parallelism:
            return Decision("scale_in",
                            parallelism=max(self.min_parallelism, min(cur - 1, max(1, want))))
        if (self.rebalance_above is not None and m.imbalance is not None and cur > 1
                and m.imbalance > self.rebalance_above and m.bucket_load is not None
                and m.owner_map is not None):
            om = rebalanced(m.bucket_load, m.owner_map, m.instances, self.rebalance_above)
            if om is not None:
                return Decision("rebalance", owner_map=om.tolist())
        return None

    def _top(self, m: BatchMetrics) -> int:
        return min(m.max_parallelism, self.max_parallelism or m.max_parallelism)

    def _move_groups(self, m: BatchMetrics) -> Optional[Decision]:
        """Key groups to move between hosts after the batch, or None (see the class doc)."""
        theta = self.rebalance_hosts_above
        since = m.batches_since_move
        if (theta is None or len(m.hosts) < 2 or m.group_load is None or m.host_map is None
                or (since is not None and since <= self.cooldown_batches)):
            return None
        keys = np.asarray(m.host_load, np.float64)
        if keys.sum() < max(1, len(m.group_load)):
            return None  # (fewer keys than groups: their loads are mostly chance)
        mean, parts = float(keys.mean()), range(len(m.hosts))
        if keys.max() > theta * mean:  # one host takes too many keys
            om = spread(m.group_load, m.host_map, parts, lambda w, h: w[h] <= theta * mean)
        else:  # one host out of instances while another has room: even out their work
            om = self._relieve(m, keys)
        if om is None:
            return None
        moved = np.flatnonzero(om != np.asarray(m.host_map))
        return Decision("rebalance_hosts", key_groups={int(g): m.hosts[int(om[g])].host
                                                       for g in moved})

    def _relieve(self, m: BatchMetrics, keys: np.ndarray) -> Optional[np.ndarray]:
        top = self._top(m)
        work = [_used(h) * h.parallelism for h in m.hosts]  # (instances' worth of work)
        hot = any(h.parallelism >= top and _used(h) > self.scale_out_above
                  and (h.batches_since_switch is None
                       or h.batches_since_switch > self.cooldown_batches) for h in m.hosts)
        if not hot or min(work) >= top * self.target or not all(keys > 0):
            return None
        cost = {i: work[i] / keys[i] for i in range(len(m.hosts))}  # (work per key)
        return spread(m.group_load, m.host_map, range(len(m.hosts)),
                      lambda w, h: w[h] <= top * self.target, cost)


def _used(m: BatchMetrics) -> float:
    """The utilization a decision goes by: the input's demand, or else the measured mean."""
    return m.demand if m.demand is not None else m.mean_utilization


def as_policy(elastic, max_parallelism: int) -> Optional[Policy]:
    """What ``elastic=`` means for a query of ``max_parallelism`` instances: None/False (no
    controller), True (``ElasticPolicy()``), or a :class:`Policy`; checked now."""
    if elastic is None or elastic is False:
        return None
    if elastic is True:
        return ElasticPolicy().bind(max_parallelism)
    if isinstance(elastic, Policy):
        return elastic.bind(max_parallelism)
    raise TypeError(f"elastic={elastic!r}: use True, an ElasticPolicy(...) or a "
                    "spark_stretch.Policy subclass")
