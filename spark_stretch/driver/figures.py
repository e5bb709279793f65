"""What an elastic policy sees and says: a batch's figures (:class:`BatchMetrics`) and a
reconfiguration (:class:`Decision`). Both are exported from :mod:`spark_stretch` and
:mod:`.policy`.

Examples
--------
>>> from spark_stretch.driver.figures import BatchMetrics, Decision
>>> m = BatchMetrics(batch=3, parallelism=2, max_parallelism=4, utilization=[0.5, 0.7])
>>> m.mean_utilization, m.row()["utilization_max"]
(0.6, 0.7)
>>> Decision("scale_out", parallelism=3, host="10.0.0.2")
Decision(cause='scale_out', parallelism=3, host='10.0.0.2')
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["BatchMetrics", "CAUSES", "Decision"]

#: The causes of a reconfiguration: the user's ``reconfigure``, or a policy's decision
#: (``rebalance``: buckets between a host's instances; ``rebalance_hosts``: key groups
#: between hosts).
CAUSES = ("manual", "scale_out", "scale_in", "rebalance", "rebalance_hosts")


@dataclass
class BatchMetrics:
    """One micro-batch's figures, as a policy sees them (and as ``q.metrics()["per_batch"]``
    keeps them, without the arrays ``bucket_load``, ``owner_map``, ``group_load`` and
    ``host_map``, and with each host's figures summed up: :meth:`host_row`).

    Rates are per second; times in milliseconds; ``utilization``, ``busy_ms`` and ``load`` are
    per active instance (``instances``). An instance's utilization is its busy time in the
    batch's step over the time the batch had: the trigger interval of a processing-time trigger,
    else the wall time since the previous step ended (it exceeds 1 when the engine falls
    behind). ``demand`` is the mean utilization the batch's *input* takes at the instances'
    cost per processed tuple (their busy time per tuple in the last few steps at this
    parallelism, times the input rows, over the batch's time; None until known): in
    append mode the watermark releases a batch's rows to the instances one batch later, so the
    input is what the next step processes, and ``demand`` sees a rate step one batch before
    ``utilization`` does. ``imbalance`` is the busiest instance's load over the mean (keys
    processed, the drop-in: rows). ``batches_since_switch``: batches stepped since the last
    epoch switch, this one included (None: none yet). ``live_windows`` (the drop-in: keys in
    state), ``rows_updated``, ``rows_removed`` and ``late_rows`` are the state operator's rows
    after the step, written and removed by it, and the input rows it dropped as late.

    On several hosts, ``hosts`` holds each host's figures (a ``BatchMetrics`` each, in host
    order: its ``host`` name, its instances and their figures, ``parallelism``, ``demand``,
    ``bucket_load``, ``owner_map`` and ``batches_since_switch`` of its own, the ``key_groups``
    it owns and ``group_load``, their keys), and the query's figures are over all of them:
    ``parallelism`` every host's instances, ``utilization``, ``busy_ms`` and ``load`` every
    host's instances in host order, ``demand`` the mean over the instances, rows, tuples and
    state summed (a row routed to two hosts counts on each). ``group_load`` is the keys each
    key group took in the batch (a pair: its first word), ``host_map`` each group's host (its
    index in ``hosts``), ``host_load`` each host's keys, ``host_imbalance`` the busiest host's
    over the mean, and ``batches_since_move`` the batches since key groups last moved.
    """

    batch: int
    parallelism: int
    max_parallelism: int
    utilization: List[float] = field(default_factory=list)
    instances: List[int] = field(default_factory=list)
    busy_ms: List[float] = field(default_factory=list)
    load: Optional[List[int]] = None
    imbalance: Optional[float] = None
    demand: Optional[float] = None
    input_rows: int = 0
    input_rate: Optional[float] = None
    processed_rate: Optional[float] = None
    latency_p50_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    step_ms: float = 0.0
    budget_ms: float = 0.0
    tuples: int = 0
    epoch: int = 0
    live_windows: int = 0
    state_bytes: int = 0
    state_disk_bytes: Optional[int] = None  # (a state store on disk: the drop-in's)
    # the operator's own counters, as Spark names them (transformWithState's numValueStateVars..)
    operator_metrics: Dict[str, int] = field(default_factory=dict)
    rows_updated: int = 0
    rows_removed: int = 0
    late_rows: int = 0
    time_ms: int = 0
    batches_since_switch: Optional[int] = None
    switched: Optional[str] = None
    switch_ms: Optional[float] = None
    host: Optional[str] = None
    key_groups: Optional[List[int]] = None
    hosts: Optional[List["BatchMetrics"]] = field(default=None, repr=False)
    host_load: Optional[List[int]] = None
    host_imbalance: Optional[float] = None
    batches_since_move: Optional[int] = None
    bucket_load: Optional[np.ndarray] = field(default=None, repr=False)
    owner_map: Optional[np.ndarray] = field(default=None, repr=False)
    group_load: Optional[np.ndarray] = field(default=None, repr=False)
    host_map: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def mean_utilization(self) -> float:
        return float(np.mean(self.utilization)) if self.utilization else 0.0

    @property
    def max_utilization(self) -> float:
        return float(np.max(self.utilization)) if self.utilization else 0.0

    def row(self) -> dict:
        """The batch's row of ``q.metrics()["per_batch"]`` (plain values, no arrays; each
        host's figures as :meth:`host_row`)."""
        out = {k: v for k, v in self.__dict__.items() if k not in _ARRAYS}
        out.update(utilization_mean=self.mean_utilization, utilization_max=self.max_utilization)
        if self.hosts is not None:
            out["hosts"] = [h.host_row() for h in self.hosts]
        return out

    def host_row(self) -> dict:
        """A host's figures as its entry of the batch row's ``hosts``: its name, parallelism,
        key groups (how many), ``load`` (their keys), utilization, demand, imbalance, input
        rows, tuples, and the last switch of its instances."""
        return {"host": self.host, "parallelism": self.parallelism,
                "key_groups": len(self.key_groups or ()),
                "load": None if self.group_load is None else int(self.group_load.sum()),
                "utilization_mean": self.mean_utilization,
                "utilization_max": self.max_utilization, "demand": self.demand,
                "imbalance": self.imbalance, "input_rows": self.input_rows,
                "tuples": self.tuples, "batches_since_switch": self.batches_since_switch,
                "switched": self.switched}


_ARRAYS = ("bucket_load", "owner_map", "group_load", "host_map", "hosts")


@dataclass(frozen=True, repr=False)
class Decision:
    """A reconfiguration, and why (``cause``: ``"scale_out"``, ``"scale_in"``, ``"rebalance"``
    or ``"rebalance_hosts"``): a new ``parallelism`` (1..max_parallelism) and/or ``owner_map``
    (the owner instance of each bucket, every one active) of ``host``'s instances (on several
    hosts; None: every host's), or ``key_groups``: key groups to move with their state,
    ``{group: host}``.

    Examples
    --------
    >>> Decision("rebalance_hosts", key_groups={3: "10.0.0.2"})
    Decision(cause='rebalance_hosts', key_groups={3: '10.0.0.2'})
    >>> Decision("scale_out", parallelism=2, key_groups={3: "10.0.0.2"})
    Traceback (most recent call last):
    ...
    ValueError: Decision: key_groups= moves key groups between hosts; give parallelism=, owner_map= and host= in a decision of its own
    """

    cause: str
    parallelism: Optional[int] = None
    owner_map: Optional[Sequence[int]] = None
    host: Optional[str] = None
    key_groups: Optional[Mapping[int, str]] = None

    def __post_init__(self):
        if self.cause not in CAUSES[1:]:
            raise ValueError(f"Decision: cause={self.cause!r}; use one of {CAUSES[1:]}")
        if self.key_groups is not None:
            if (self.parallelism, self.owner_map, self.host) != (None, None, None):
                raise ValueError("Decision: key_groups= moves key groups between hosts; give "
                                 "parallelism=, owner_map= and host= in a decision of its own")
            if not isinstance(self.key_groups, Mapping) or not self.key_groups:
                raise ValueError(f"Decision: key_groups={self.key_groups!r}; give the groups "
                                 "to move and their host, {group: host}")
        elif self.parallelism is None and self.owner_map is None:
            raise ValueError("Decision: give parallelism=, owner_map= or key_groups=")

    def __repr__(self) -> str:
        given = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)[1:]
                 if getattr(self, f.name) is not None]
        return f"Decision({', '.join([f'cause={self.cause!r}', *given])})"
