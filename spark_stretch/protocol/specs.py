"""The spec of a query as its host engine gets it with ``open``: versioned, typed, JSON on the wire.

The driver builds one from the user's call (:mod:`spark_stretch.api`) and the session's settings
(:mod:`spark_stretch.driver.settings`); the host engine opens the runtime its ``kind`` names
(:mod:`spark_stretch.host.daemon`). A spec of another version is refused with a clear error,
never half understood.

Examples
--------
>>> from spark_stretch.protocol.specs import AggregateSpec, spec_from_wire, spec_to_wire
>>> s = AggregateSpec(ts_column="ts", delay_ms=10_000, key_kind="array", key_column="words",
...                   key_type="string", window_us=60_000_000, slide_us=60_000_000,
...                   aggs=[("count", None)])
>>> spec_from_wire(spec_to_wire(s)) == s
True
>>> s.output_names()
['count']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

import msgspec

from .errors import BadRequest

__all__ = ["SPEC_VERSION", "Checkpointing", "HostShare", "QuerySpec", "AggregateSpec", "OperatorSpec",
           "StreamSpec", "GroupedSpec", "spec_from_wire", "spec_to_wire", "parse_bytes"]

SPEC_VERSION = 1


@dataclass(kw_only=True)
class Checkpointing:
    """Where and how the host engine checkpoints a query (Spark's state store settings where
    Spark has one: ``minDeltasForSnapshot``, ``minBatchesToRetain``)."""

    state_dir: Optional[str] = None   # <checkpointLocation>/stretch/state; None: no checkpoints
    interval: int = 10                # batches between two checkpoints (the input log between)
    min_deltas: int = 10              # deltas in a chain before a full checkpoint
    min_batches_to_retain: int = 100
    fsync: bool = False


@dataclass(kw_only=True)
class HostShare:
    """One host's share of a query that runs on several hosts (:mod:`.placement`): the query's
    key space is split into ``key_groups`` groups, ``host_map[g]`` the index of the host that
    owns group ``g``; this engine is host ``host`` of ``hosts``. It keeps the keys of the
    groups it owns, and every input stream's event times (for the one watermark)."""

    host: int
    hosts: int
    key_groups: int
    host_map: List[int]

    def owned(self) -> List[int]:
        """The key groups this host owns."""
        return [g for g, h in enumerate(self.host_map) if h == self.host]

    def groups_changed(self, was: Optional[List[int]]) -> bool:
        """Whether the groups this host owns differ from those it owned under the host map
        ``was`` (a checkpoint's; None: it had none): a host whose groups stayed continues from
        its own checkpoint, whatever moved elsewhere."""
        if was is None or len(was) != len(self.host_map):
            return True
        return any((w == self.host) != (h == self.host) for w, h in zip(was, self.host_map))


@dataclass(kw_only=True)
class QuerySpec:
    """What every query kind's spec has: its sizes, its checkpoint, and where it resumes."""

    kind: ClassVar[str] = ""
    version: int = SPEC_VERSION
    parallelism: int = 1               # instances updating state at the start (m)
    max_parallelism: int = 4           # instances created (n)
    buckets: int = 4096                # state buckets (B)
    checkpoint: Checkpointing = field(default_factory=Checkpointing)
    resume_batch: Optional[int] = None  # continue after this batch (Spark's last committed)
    input_schema: Optional[str] = None  # the input's Arrow schema (base64 IPC), for the warm-up
    warm_up: bool = False               # a throwaway copy warming the engine up
    share: Optional[HostShare] = None   # on several hosts: this host's key groups (None: one)
    state_memory: int = 0               # bytes of state the engine keeps in memory, the rest
    #                                     on local disk (spark.stretch.state.memory; 0: half
    #                                     the host's memory)


@dataclass(kw_only=True)
class AggregateSpec(QuerySpec):
    """Built-in windowed aggregations (``stretchAggregate(keys=..., agg=...)``)."""

    kind: ClassVar[str] = "aggregate"
    ts_column: str
    delay_ms: int
    key_kind: str                      # "scalar" | "array" | "pairs"
    key_column: str
    key_type: str                      # "string" | "long" | "binary" (several columns, encoded)
    key_nullable: bool = False         # a scalar string or long key column with nulls: the null
    #                                    key's id is -1 (strings) or NULL_LONG_KEY (longs)
    distance: Optional[int] = None     # pairs: largest j - i (None: every pair)
    window_us: int
    slide_us: int
    aggs: List[tuple]                  # (fn, column), fn in count/sum/min/max/mean/first/
    #                                    last, or (fn, column, other): fn first_if/last_if
    #                                    (rows whose column other is 0 skipped), max_by/min_by
    #                                    (ordered by the column other)
    value_types: Dict[str, str] = field(default_factory=dict)  # column -> "long" | "double"
    drop_null_ts: bool = False         # rows without an event time are in no window (Spark's
    #                                    window); False: an error naming the column
    finish: Optional[list] = None      # the output as Spark's result columns ({"name", "expr"}
    #                                    each, host/columns.finish), or the engine's own columns
    session_end: Optional[str] = None  # session windows (window_us = slide_us = 0): the input
    #                                    column of each row's session end (ts + its gap)
    prepare: Optional[list] = None     # the engine's input columns from the batch's own
    #                                    ({"name", "expr"} each, host/columns.prepare), or
    #                                    None: the batch has them (Spark evaluated them)
    output_mode: str = "append"        # Spark's: "append" (a window once, when it closes),
    #                                    "update" (the windows each batch changed), "complete"

    @property
    def value_columns(self) -> List[str]:
        return sorted({c for a in self.aggs for c in a[1:] if c is not None})

    def output_names(self) -> List[str]:
        """Spark's names for the aggregations: ``count``, ``sum(x)``, ``avg(x)``, ..."""
        return ["count" if fn == "count" else
                f"{'avg' if fn == 'mean' else fn}({', '.join(c for c in cols if c)})"
                for fn, *cols in self.aggs]


@dataclass(kw_only=True)
class StreamSpec:
    """One input stream of an engine operator: its event time and the columns read, each as
    ``(engine name, kind, input column)`` with kind ``long``, ``double``, ``string``,
    ``timestamp`` or ``list``."""

    name: str
    ts_column: str
    delay_ms: int
    columns: List[Tuple[str, str, str]]


@dataclass(kw_only=True)
class OperatorSpec(QuerySpec):
    """A user's O+ operator or a join (``stretchAggregate(agg=<operator>, others=...)``)."""

    kind: ClassVar[str] = "operator"
    operator: str                      # the operator, pickled (base64), kernels left behind
    streams: List[StreamSpec]
    output: List[Tuple[str, str, str]]  # (name, kind, engine column) per result column
    window_us: Optional[int] = None
    watermark_policy: str = "min"      # spark.sql.streaming.multipleWatermarkPolicy


@dataclass(kw_only=True)
class GroupedSpec(QuerySpec):
    """A grouped stateful operator with the user's Python code: the ``applyInPandasWithState``
    drop-in (``groupBy(...).stretchApplyInPandasWithState(func, ...)``, ``api``
    ``"applyInPandasWithState"``) or ``transformWithStateInPandas`` (``stretch(df)``, ``api``
    ``"transformWithStateInPandas"``, or ``"transformWithState"`` (row-based): ``func`` is the
    ``StatefulProcessor``, ``timeout_conf`` follows ``time_mode``, ``state_schema`` is unused)."""

    kind: ClassVar[str] = "grouped"
    max_parallelism: int = 2
    buckets: int = 256
    key_columns: List[str]
    columns: List[str]
    out_schema: str                    # Spark JSON of outputStructType
    state_schema: str                  # Spark JSON of stateStructType
    output_mode: str                   # "Update" | "Append", as given
    timeout_conf: str
    ts_column: Optional[str] = None
    delay_ms: int = 0
    watermark_present: bool = False
    runner_conf: Dict[str, object] = field(default_factory=dict)  # pyspark worker's settings
    func: str = ""                     # the function, cloudpickled (base64)
    api: str = "applyInPandasWithState"
    time_mode: str = "None"            # transformWithState: None | ProcessingTime | EventTime
    state_schemas: Dict[str, str] = field(default_factory=dict)  # DDL text -> Spark JSON
    initial_state: str = ""            # transformWithState's initialState: Arrow IPC (base64)
    initial_key_columns: List[str] = field(default_factory=list)
    instance_max_failures: int = 4     # runs of an instance's share of a step whose process dies
    function_attempts: int = 1         # runs of a share whose function raises (Spark's task
    #                                    attempts for the master: 1 in local mode)


_KINDS = {c.kind: c for c in (AggregateSpec, OperatorSpec, GroupedSpec)}


def spec_to_wire(spec: QuerySpec) -> dict:
    """``spec`` as JSON-ready builtins, with its ``kind``."""
    return {"kind": spec.kind, **msgspec.to_builtins(spec)}


def spec_from_wire(d: dict) -> QuerySpec:
    """The spec in a wire dict (BadRequest: another version, an unknown kind, a bad field)."""
    if not isinstance(d, dict):
        raise BadRequest(f"a query spec is an object, got {type(d).__name__}")
    version = d.get("version")
    if version != SPEC_VERSION:
        raise BadRequest(f"query spec version {version!r}: this engine reads version "
                         f"{SPEC_VERSION} (driver and engine of different spark-stretch versions?)")
    cls = _KINDS.get(d.get("kind"))
    if cls is None:
        raise BadRequest(f"unknown query kind {d.get('kind')!r}; known: {sorted(_KINDS)}")
    try:
        return msgspec.convert({k: v for k, v in d.items() if k != "kind"}, cls)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{cls.kind} query spec: {e}") from None


def parse_bytes(text) -> int:
    """``"512m"``, ``"2g"``, ``"1048576"`` (Spark's size strings) as bytes.

    >>> parse_bytes("512m"), parse_bytes("2G"), parse_bytes(4096)
    (536870912, 2147483648, 4096)
    """
    if isinstance(text, int):
        return int(text)
    s = str(text).strip().lower().removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    try:
        return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (give one such as 512m or 2g)") from None
