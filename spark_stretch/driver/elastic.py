"""Per-batch figures of a running query, and its elastic controller, on the driver.

Each finished micro-batch's figures (the engine's, :mod:`spark_stretch.host.load`, with the
driver's times) become a :class:`~.policy.BatchMetrics`: a row of ``q.metrics()["per_batch"]``,
of the Delta metrics table (``spark.stretch.metrics.table``) and of the query's progress (the
sink's custom metrics, :func:`.jvm.foreach_batch_with_metrics`). A query with a policy asks it
for a decision there; the decision is applied before the next batch's step (no batch in
flight, :meth:`~.pipeline.Pipeline.run_batch`), an epoch switch recorded with its cause; a
decision moving key groups between hosts before the next batch's input reaches the hosts.

On several hosts each host's figures (the fan-out's list, :mod:`.fanout`) become a
``BatchMetrics`` of their own, with that host's cost per tuple and switches, and the query's
figures are made from them (:func:`merged`).

Examples
--------
>>> from spark_stretch.driver.metrics import QueryMetrics
>>> from spark_stretch.driver.policy import ElasticPolicy
>>> run = ElasticRun(ElasticPolicy(), max_parallelism=2, metrics=QueryMetrics())
>>> fig = {"step_ms": 900.0, "since_ms": 1000.0, "instances": [0], "busy_ms": [950.0],
...        "load": [100], "parallelism": 1, "epoch": 0, "end_ms_q": None, "tuples": 100,
...        "input_rows": 100, "live_windows": 10, "state_bytes": 4096}
>>> _ = run.batch_done(0, fig, written_at=None)  # (the first with input: not asked)
>>> run.pending()
[]
>>> m = run.batch_done(1, fig, written_at=None)
>>> m.utilization, m.demand     # (busy 950 ms of a 1 s batch; its input takes as much)
([0.95], 0.95)
>>> run.pending()
[Decision(cause='scale_out', parallelism=2)]
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Callable, Dict, List, Optional

import numpy as np

from .metrics import QueryMetrics
from .policy import BatchMetrics, Decision, Policy

__all__ = ["ElasticRun", "merged", "sink_figures", "state_figures", "per_batch_frame"]

_ROWS_KEPT = 10_000  # per-batch rows kept in q.metrics() (the metrics table keeps every one)
# The cost per tuple is the instances' busy time over the tuples they processed in the last
# _COST_STEPS steps at the current parallelism, once they processed _COST_TUPLES (one slow
# step of a few tuples, a table grown say, does not make it)
_COST_STEPS, _COST_TUPLES = 4, 100


class _Track:
    """The running figures of a host's instances (or of the query's): batches stepped since
    they last switched, the switch before their next step, and their recent costs per tuple
    ((mean busy ms, tuples) of the last steps since the switch)."""

    def __init__(self):
        self.since: Optional[int] = None
        self.switch: Optional[dict] = None
        self.costs: deque = deque(maxlen=_COST_STEPS)
        self.stepped_input = False  # (the first step with input pays one-time costs)

    def switched(self, record: dict) -> None:
        self.since, self.switch = 0, record
        self.costs.clear()  # (another parallelism: another cost per tuple)


class ElasticRun:
    """One query's per-batch figures and, with a ``policy``, its decisions.

    ``interval_ms()``: the query's processing-time trigger interval, or None; ``table``: the
    Delta metrics table's appender (or None).
    """

    def __init__(self, policy: Optional[Policy], max_parallelism: int, metrics: QueryMetrics,
                 interval_ms: Callable[[], Optional[int]] = lambda: None, table=None):
        self.policy = policy
        self._max = max_parallelism
        self._metrics = metrics
        self._interval_ms = interval_ms
        self._table = table
        self._lock = threading.Lock()
        self._started: dict = {}           # batch -> its foreachBatch's start (perf_counter)
        self._last_start: Optional[float] = None
        self._pending: List[Decision] = []
        # the query's instances (None), or on several hosts each host's by name
        self._tracks: Dict[Optional[str], _Track] = {None: _Track()}
        self._since_move: Optional[int] = None  # batches since key groups last moved
        self.latest: Optional[BatchMetrics] = None

    # -- asked by the pipeline ---------------------------------------------------------------
    def started(self, batch: int) -> None:
        """Batch ``batch``'s ``foreachBatch`` began (its input rate is over the time since the
        previous one began)."""
        now = time.perf_counter()
        with self._lock:
            gap = None if self._last_start is None else now - self._last_start
            self._last_start = now
            self._started[batch] = gap
            for b in [b for b in self._started if b < batch - 8]:
                del self._started[b]

    def batch_done(self, batch: int, figures: dict, written_at: Optional[float]) -> BatchMetrics:
        """A batch's output is written (at ``written_at``, ``time.time()``): its figures
        recorded, and the policy asked."""
        with self._lock:
            # (whether a batch with input was stepped before this one, on any host)
            stepped_before = any(t.stepped_input for t in self._tracks.values())
            for t in self._tracks.values():
                t.since = None if t.since is None else t.since + 1
            if self._since_move is not None:
                self._since_move += 1
            hosts = figures.get("hosts")
            if hosts is None:
                m = self._metrics_of(batch, figures, written_at, self._tracks[None])
            else:
                g = int(figures.get("key_groups") or 0)
                per = [self._metrics_of(batch, f, written_at, self._track(f["host"]), g)
                       for f in hosts]
                top = self._tracks[None]
                m = merged(batch, per, self._max, g, top.since, self._since_move,
                           None if top.switch is None else top.switch.get("cause"))
                top.switch = None
            self.latest = m
        self._metrics.append("per_batch", m.row(), keep=_ROWS_KEPT)
        if self._table is not None:
            self._table.append(m.row())
        first_input = m.tuples > 0 and not stepped_before
        if self.policy is not None and not first_input:  # (its time is one-time costs' too)
            try:
                got = self.policy.decide(m)
                got = [] if got is None else [got] if isinstance(got, Decision) else list(got)
                wrong = [d for d in got if not isinstance(d, Decision)]
                if wrong:
                    raise TypeError(f"decide() returned {wrong[0]!r}; return a Decision, a "
                                    "list of them, or None")
            except Exception as e:  # (fails the query, as an error in foreachBatch would)
                raise RuntimeError(f"stretch: the elastic policy {self.policy!r} failed on "
                                   f"batch {batch}: {type(e).__name__}: {e}") from e
            if got:
                with self._lock:
                    self._pending = got
        return m

    def pending(self, moves: bool = False) -> List[Decision]:
        """The decisions to apply before the next batch's step (``moves``: those moving key
        groups, applied before its input reaches the hosts); taken: asked once."""
        with self._lock:
            out = [d for d in self._pending if (d.key_groups is not None) == moves]
            self._pending = [d for d in self._pending if d not in out]
            return out

    def move_pending(self) -> bool:
        """Whether a decision moving key groups waits."""
        with self._lock:
            return any(d.key_groups is not None for d in self._pending)

    def switched(self, record: dict) -> None:
        """An epoch switch happened (a decision applied, or the user's ``reconfigure``; on
        several hosts, of one host's instances if the record names it), or key groups moved
        (the record has ``key_groups``: every host's load changed)."""
        with self._lock:
            host = record.get("host")
            if "key_groups" in record:
                self._since_move = 0
            for name, t in self._tracks.items():
                if host is None or name is None:
                    t.switched(record)
            if host is not None:
                self._track(host).switched(record)
            if record.get("cause") == "manual":
                self._pending = []  # (decided under the configuration the user changed)

    def _track(self, host: str) -> _Track:
        t = self._tracks.get(host)
        if t is None:
            t = self._tracks[host] = _Track()
        return t

    # -- the figures ---------------------------------------------------------------------------
    def _metrics_of(self, batch, f, written_at, track: _Track, groups: int = 0) -> BatchMetrics:
        """A batch's figures (``f``: one host engine's) as a ``BatchMetrics`` (on several hosts
        with ``groups`` key groups: one host's)."""
        switch, track.switch = track.switch, None
        step_ms = float(f.get("step_ms") or 0.0)
        budget = self._interval_ms() or f.get("since_ms") or step_ms or 1.0
        busy = [float(x) for x in f.get("busy_ms", [])]
        load = f.get("load")
        total = float(sum(load)) if load else 0.0
        imbalance = (max(load) / (total / len(load))) if load and total > 0 else None
        gap = self._started.get(batch)
        rows = int(f.get("input_rows", 0))
        tuples = int(f.get("tuples", 0))
        if tuples and busy and track.stepped_input:  # (not the first: the kernels' first run,
            track.costs.append((float(np.mean(busy)), tuples))  # the state's first pages)
        track.stepped_input = track.stepped_input or tuples > 0
        seen = sum(t for _, t in track.costs)
        demand = (sum(b for b, _ in track.costs) / seen * rows / budget
                  if seen >= _COST_TUPLES else None)
        p50 = p99 = None
        q = f.get("end_ms_q")
        if q and written_at is not None:
            now_ms = written_at * 1e3
            p50, p99 = now_ms - q[0], now_ms - q[1]
        ba = f.get("bucket_load")
        om = f.get("owner_map")
        gl = None
        if "group_load" in f:
            gl = np.zeros(groups, np.int64)
            for g, n in f["group_load"]:
                gl[g] = n
        return BatchMetrics(
            batch=batch, parallelism=int(f.get("parallelism", 0)), max_parallelism=self._max,
            utilization=[b / budget for b in busy], instances=list(f.get("instances", [])),
            busy_ms=busy, load=load, imbalance=imbalance, demand=demand, input_rows=rows,
            input_rate=(rows / gap) if gap else None,
            processed_rate=(f.get("tuples", 0) / (step_ms / 1e3)) if step_ms > 0 else None,
            latency_p50_ms=p50, latency_p99_ms=p99, step_ms=step_ms, budget_ms=float(budget),
            tuples=tuples, epoch=int(f.get("epoch", 0)),
            live_windows=int(f.get("state_rows", f.get("live_windows", 0))),
            state_bytes=int(f.get("state_bytes", 0)),
            state_disk_bytes=f.get("state_disk_bytes"), rows_updated=int(f.get("rows_updated", 0)),
            operator_metrics=dict(f.get("operator_metrics") or {}),
            rows_removed=int(f.get("rows_removed", 0)), late_rows=int(f.get("late_rows", 0)),
            time_ms=int((written_at or time.time()) * 1e3), batches_since_switch=track.since,
            switched=None if switch is None else switch.get("cause"),
            switch_ms=None if switch is None else switch.get("switch_ms"),
            host=f.get("host"), key_groups=f.get("key_groups"), group_load=gl,
            bucket_load=None if ba is None else np.asarray(ba, np.int64),
            owner_map=None if om is None else np.asarray(om, np.int64))

    def sink_figures(self) -> dict:
        """The latest batch's figures as the query's progress carries them."""
        return sink_figures(self.latest)

    def state_figures(self) -> dict:
        """The latest batch's figures as the query's state operator in its progress."""
        return state_figures(self.latest)


_SINK_KEYS = (("batch", "batch"), ("parallelism", "parallelism"), ("epoch", "epoch"),
              ("inputRows", "input_rows"), ("inputRate", "input_rate"),
              ("processedRate", "processed_rate"), ("latencyP50Ms", "latency_p50_ms"),
              ("latencyP99Ms", "latency_p99_ms"), ("utilizationMean", "utilization_mean"),
              ("utilizationMax", "utilization_max"), ("demand", "demand"),
              ("imbalance", "imbalance"), ("hostImbalance", "host_imbalance"),
              ("stepMs", "step_ms"), ("liveWindows", "live_windows"),
              ("stateBytes", "state_bytes"), ("switched", "switched"), ("switchMs", "switch_ms"))


def merged(batch: int, hosts: List[BatchMetrics], max_parallelism: int, groups: int,
           since: Optional[int], since_move: Optional[int], switched: Optional[str]
           ) -> BatchMetrics:
    """The query's figures of a batch on several hosts, from each host's (``hosts``, in host
    order; ``groups`` key groups): instances, rows, tuples and state over all of them, the
    latency of the slowest host's rows, and the hosts' key loads.

    Examples
    --------
    >>> a = BatchMetrics(batch=1, parallelism=1, max_parallelism=2, utilization=[0.9],
    ...                  load=[30], key_groups=[0], group_load=np.array([30, 0]), host="a")
    >>> b = BatchMetrics(batch=1, parallelism=2, max_parallelism=2, utilization=[0.2, 0.1],
    ...                  load=[5, 5], key_groups=[1], group_load=np.array([0, 10]), host="b")
    >>> m = merged(1, [a, b], 2, 2, since=None, since_move=None, switched=None)
    >>> m.parallelism, m.host_load, m.host_imbalance, m.host_map.tolist()
    (3, [30, 10], 1.5, [0, 1])
    """
    gl = np.zeros(groups, np.int64)
    hm = np.full(groups, -1, np.int64)
    for i, h in enumerate(hosts):
        if h.group_load is not None:
            gl += h.group_load
        hm[list(h.key_groups or ())] = i
    host_load = [int(gl[list(h.key_groups or ())].sum()) for h in hosts]
    mean = sum(host_load) / len(hosts) if hosts else 0
    load = None if any(h.load is None for h in hosts) else [x for h in hosts for x in h.load]
    total = float(sum(load)) if load else 0.0
    par = sum(h.parallelism for h in hosts)
    demands = [h.demand for h in hosts]
    rates = [h.input_rate for h in hosts if h.input_rate is not None]
    done = [h.processed_rate for h in hosts if h.processed_rate is not None]
    lat = [(h.latency_p50_ms, h.latency_p99_ms) for h in hosts if h.latency_p99_ms is not None]

    def total_of(name):
        return sum(getattr(h, name) for h in hosts)

    operator = Counter()  # (update, not +: a counter of 0 stays)
    for h in hosts:
        operator.update(h.operator_metrics)

    return BatchMetrics(
        batch=batch, parallelism=par, max_parallelism=max_parallelism,
        utilization=[u for h in hosts for u in h.utilization],
        instances=[j for h in hosts for j in h.instances],
        busy_ms=[b for h in hosts for b in h.busy_ms], load=load,
        imbalance=max(load) / (total / len(load)) if load and total > 0 else None,
        demand=(None if None in demands or not par else
                sum(d * h.parallelism for d, h in zip(demands, hosts)) / par),
        input_rows=total_of("input_rows"), input_rate=sum(rates) if rates else None,
        processed_rate=sum(done) if done else None,
        latency_p50_ms=max(p for p, _ in lat) if lat else None,
        latency_p99_ms=max(p for _, p in lat) if lat else None,
        step_ms=max((h.step_ms for h in hosts), default=0.0),
        budget_ms=max((h.budget_ms for h in hosts), default=0.0),
        tuples=total_of("tuples"), epoch=max((h.epoch for h in hosts), default=0),
        live_windows=total_of("live_windows"), state_bytes=total_of("state_bytes"),
        state_disk_bytes=(None if all(h.state_disk_bytes is None for h in hosts)
                          else sum(h.state_disk_bytes or 0 for h in hosts)),
        operator_metrics=dict(operator),
        rows_updated=total_of("rows_updated"), rows_removed=total_of("rows_removed"),
        late_rows=total_of("late_rows"), time_ms=max((h.time_ms for h in hosts), default=0),
        batches_since_switch=since, switched=switched,
        switch_ms=max((h.switch_ms for h in hosts if h.switch_ms is not None), default=None),
        hosts=hosts, host_load=host_load,
        host_imbalance=max(host_load) / mean if mean > 0 else None,
        batches_since_move=since_move, group_load=gl, host_map=hm)


def sink_figures(m: Optional[BatchMetrics]) -> dict:
    """``stretch.<name>`` -> value of a batch's figures (None ones left out), as Spark's
    progress carries them in ``sink.metrics`` (camelCase, like the progress's own keys).

    Examples
    --------
    >>> sink_figures(BatchMetrics(batch=3, parallelism=2, max_parallelism=4, input_rate=10.5))
    ... # doctest: +NORMALIZE_WHITESPACE
    {'stretch.batch': 3, 'stretch.parallelism': 2, 'stretch.epoch': 0, 'stretch.inputRows': 0,
     'stretch.inputRate': 10.5, 'stretch.utilizationMean': 0.0, 'stretch.utilizationMax': 0.0,
     'stretch.stepMs': 0.0, 'stretch.liveWindows': 0, 'stretch.stateBytes': 0}
    """
    if m is None:
        return {}
    row = m.row()
    return {f"stretch.{name}": row[key] for name, key in _SINK_KEYS if row.get(key) is not None}


def state_figures(m: Optional[BatchMetrics]) -> dict:
    """A batch's figures as the fields of the query's ``StateOperatorProgress`` (Spark's
    progress: ``stateOperators``); ``customMetrics`` are longs, as Spark's are: the batch,
    parallelism, epoch, the step's and the busiest instance's milliseconds, and the epoch
    switch before the step in microseconds.

    Examples
    --------
    >>> f = state_figures(BatchMetrics(batch=3, parallelism=2, max_parallelism=4,
    ...                                live_windows=10, rows_updated=4, busy_ms=[1.5, 2.6]))
    >>> f["numRowsTotal"], f["numRowsUpdated"], f["customMetrics"]["busyMsMax"]
    (10, 4, 3)
    >>> state_figures(None)
    {}
    """
    if m is None:
        return {}
    custom = {"batch": m.batch, "parallelism": m.parallelism,
              "maxParallelism": m.max_parallelism, "epoch": m.epoch,
              "stepMs": round(m.step_ms), "busyMsMax": round(max(m.busy_ms, default=0.0))}
    if m.switch_ms is not None:
        custom["epochSwitchMicros"] = round(m.switch_ms * 1e3)
    if m.state_disk_bytes is not None:  # the state's files (the drop-in's store, the tables
        #                                 past the engine's memory budget)
        custom["stateOnDiskBytes"] = int(m.state_disk_bytes)
    custom.update(m.operator_metrics)
    return {"numRowsTotal": m.live_windows, "numRowsUpdated": m.rows_updated,
            "numRowsRemoved": m.rows_removed, "memoryUsedBytes": m.state_bytes,
            "numRowsDroppedByWatermark": m.late_rows, "allUpdatesTimeMs": round(m.step_ms),
            "numStateStoreInstances": m.parallelism, "customMetrics": custom}


def per_batch_frame(figures: dict):
    """``q.metrics()``'s ``per_batch`` rows as a pandas DataFrame, one row per batch, with
    ``time`` as a timestamp (UTC) and ``seconds`` since the first row.

    Examples
    --------
    >>> rows = [BatchMetrics(batch=b, parallelism=1, max_parallelism=2, time_ms=1000 * b,
    ...                      utilization=[0.5]).row() for b in range(3)]
    >>> per_batch_frame({"per_batch": rows})[["batch", "seconds", "utilization_max"]]
       batch  seconds  utilization_max
    0      0      0.0              0.5
    1      1      1.0              0.5
    2      2      2.0              0.5
    """
    import pandas as pd

    df = pd.DataFrame(figures.get("per_batch") or [])
    if len(df):
        df["time"] = pd.to_datetime(df["time_ms"], unit="ms", utc=True)
        df["seconds"] = (df["time_ms"] - df["time_ms"].iloc[0]) / 1e3
    return df
