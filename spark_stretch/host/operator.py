"""A custom engine operator inside the host engine process: one or two input streams, Arrow out.

The query kind ``"operator"`` of :mod:`spark_stretch.api.operators`: a user's O+ operator (numba
``f_MK``/``f_U``/``f_O``/``f_S``) or a J+ join (:class:`~spark_stretch.engine.JoinOperator`), with
``I = 2`` when the query has ``others=``. Everything per batch is as for ``stretchAggregate``
(:class:`~spark_stretch.host.aggregate.AggregateRuntime`: Spark's late rule and watermark timeline,
checkpoints, replay, reconfiguration); what differs is here:

- the batch is the union of the streams' rows, tagged by ``__stream``; stream ``s``'s rows go to
  ESG source ``s`` (stream ``s`` of the operator), their columns renamed back from ``__s<s>_<c>``;
- each stream has its own watermark delay, and the global watermark is Spark's (the min of the
  streams', or the max under ``multipleWatermarkPolicy=max``);
- a join's stored payload carries each side's event time, so a result row has both.

Two streams are one Spark query (a union is narrow: no Exchange), so one micro-batch, one
checkpoint, one Delta version and one replay cover both; two queries feeding one engine would
need their own agreement on batch boundaries and watermarks, which Spark does not offer. The
global watermark is Spark's ``WatermarkTracker``'s: per stream its largest event time minus its
delay (0 before it has seen data), the min of them, never moving back. A join (or a keyed
operator without windows) drops a row with ``ts <= W_{N-1}``, as Spark's stream-stream join
does; a windowed O+ operator uses the window rule of aggregations. Results come out in
timestamp order when the watermark passes the later tuple of a pair (a tuple, for
pass-through): Spark's join emits a match as soon as both rows are there, so the rows are the
same but later by up to the watermark delay, and deterministic in content and order for any
parallelism and reconfiguration. A join's result columns are the columns it reads, ``l_<c>``
and ``r_<c>``, each side's event time included (a float64 in the payload: exact below 2^53
microseconds), with the input's types (strings interned in the engine, decoded back).
Operators arrive pickled (numba dispatchers pickle their Python function) and compile here.
Spark's stream-stream join needs an equality predicate, which a band join has none of: its
native equivalent (the tests' oracle) joins on grid cells of the band's size (the left row
exploded to its 3 x 3 neighbouring cells), then applies the band and the time range.

No Spark import here.
"""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine import JoinOperator, ListColumn
from ..protocol.errors import InputRejected
from .aggregate import AggregateRuntime
from .columns import TS, list_parts, window_array

__all__ = ["OperatorRuntime", "TS_PAYLOAD"]

TS_PAYLOAD = "__ts"  # the join payload column holding a tuple's event time (microseconds)


class OperatorRuntime(AggregateRuntime):
    """The engine side of a custom-operator query (``spec``: an
    :class:`~spark_stretch.protocol.specs.OperatorSpec`)."""

    def _operators(self) -> list:
        op = pickle.loads(base64.b64decode(self.spec.operator))
        if isinstance(op, JoinOperator):  # both sides' event times ride in the stored payload
            op = JoinOperator(WS=op.WS, left=(*op.left, TS_PAYLOAD), right=(*op.right, TS_PAYLOAD),
                              shares=op.shares, pred=op.pred, fp=op.fp, name=op.name)
        return [op]

    # (its state rows are its live windows or stored tuples; what a step changed of them, the
    # user's kernel knows)
    windows_changed = False

    def _lateness(self, op) -> str:
        # Windows: Spark's rule for window aggregations; otherwise (joins, keyed state) a tuple
        # at or below the watermark is late, as Spark's stream-stream join drops it.
        return "tuple" if isinstance(op, JoinOperator) or op.WA is None else "window"

    def _delays(self) -> list:
        return [s.delay_ms for s in self.spec.streams]

    def _parts(self, table: pa.Table) -> list:
        """The batch's rows of each input stream (tagged ``__stream`` when there are two)."""
        if len(self.spec.streams) == 1:
            return [table]
        tag = table.column("__stream")
        return [table.filter(pc.equal(tag, s)) for s in range(len(self.spec.streams))]

    def _arrived(self, table: pa.Table) -> pa.Table:
        return table  # (the shim never leaves an operator's input projection to the engine)

    def _validate(self, table: pa.Table, batch: int) -> None:
        for s, (part, st) in enumerate(zip(self._parts(table), self.spec.streams)):
            ts = part.column("__ts")
            if ts.null_count:
                raise InputRejected(f"event-time column '{st.ts_column}' of input {st.name} has "
                                    f"{ts.null_count} nulls in batch {batch}")
            for name, kind, spark_name in st.columns:
                if name == "ts":
                    continue  # the event time itself, checked above
                arr = part.column(f"__s{s}_{spark_name}")
                what = f"column '{spark_name}'"
                if kind == "list":
                    arr, what = pc.list_flatten(arr), f"elements of column '{spark_name}'"
                if arr.null_count:
                    raise InputRejected(f"{what} of input {st.name} has {arr.null_count} nulls "
                                        f"in batch {batch}; the operator needs values (fill or "
                                        "filter them first)")

    def _stream_columns(self, table: pa.Table, share=None) -> list:
        join = isinstance(self.engines[0].op, JoinOperator)
        out = []
        for s, (part, st) in enumerate(zip(self._parts(table), self.spec.streams)):
            if not part.num_rows:
                out.append(None)
                continue
            cols = {"ts": pc.cast(part.column("__ts"), pa.int64()).to_numpy()}
            for name, kind, spark_name in st.columns:
                if name == "ts":
                    continue  # the event time itself (checked when the query was built)
                cols[name] = self._convert(part.column(f"__s{s}_{spark_name}").combine_chunks(),
                                           kind)
            if join:
                cols[TS_PAYLOAD] = cols["ts"]
            out.append(cols)
        return out

    def _convert(self, arr: pa.Array, kind: str):
        if kind == "list":
            offsets, values = list_parts(arr)
            return ListColumn(offsets, self.codec.ids(values,
                                                      force_intern=pa.types.is_string(values.type)))
        if kind == "string":
            return self.codec.ids(arr, force_intern=True)
        if kind == "double":
            return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
        return pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False)  # long, timestamp (us)

    def _output(self) -> pa.Table:
        out = self.engines[0].esg_out.get_batch("driver")[0]
        arrays, names = [], []
        for name, kind, src in self.spec.output:
            if src == "window":
                arrays.append(window_array(out["window_start"], self.spec.window_us))
            else:
                arrays.append(self._typed(np.asarray(out[src]), kind))
            names.append(name)
        return pa.Table.from_arrays(arrays, names=names)

    def _typed(self, v: np.ndarray, kind: str) -> pa.Array:
        if kind == "double":
            return pa.array(v.astype(np.float64))
        ints = v.astype(np.int64) if v.dtype != np.float64 else np.rint(v).astype(np.int64)
        if kind == "timestamp":
            return pa.array(ints).cast(TS)
        if kind == "string":
            return self.codec.strings(ints)
        return pa.array(ints)
