"""One instance process of the ``transformWithStateInPandas`` drop-in: the user's
``StatefulProcessor`` per key, its state in the host's store, read and written in this process.

Natively each state call of a Python processor is a protobuf request to the JVM's state server
over a socket. Here the processor's handle is :class:`~.handle.StoreHandle`: a key's state variables and
timers are one entry of the drop-in's store (:class:`~spark_stretch.engine.keyed.KeyedStore`),
read once when the key's call starts and written with the instance's step, so a state call is
a dictionary access.

Per batch, as ``TransformWithStateInPySparkExec`` and pyspark's worker do per partition: a fresh
copy of the processor, ``init(handle)``; ``handleInputRows(key, rows, timerValues)`` for each key
with data, in key order (its rows as pandas DataFrames of at most ``maxRecordsPerBatch`` rows);
then ``handleExpiredTimer`` for each timer earlier than the batch timestamp (``ProcessingTime``)
or the eviction watermark (``EventTime``), in timer order, the timer deleted after its call;
state whose TTL has expired dropped; ``close()``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
from pyspark.errors import PySparkRuntimeError
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
from pyspark.sql.types import Row, StructType

from ..engine.keyed import RESERVED_BUCKET, encode_key
from ..protocol import instances as I
from .handle import TTL_TIMERS, Codec, KeyState, StoreHandle, normalize, prune_expired
from .instance import Instance
from .output import to_arrow

__all__ = ["ProcessorInstance", "VARIABLES"]

# The store key of the query's dropped variables and state schemas
VARIABLES = RESERVED_BUCKET.to_bytes(2, "big") + b"variables"


class _Output:
    """What pyspark's serializers do with what the processor returns: each DataFrame converted
    with pyspark's conversion (columns by name, Arrow casts:
    ``TransformWithStateInPandasSerializer``), or the Rows as dicts into Arrow of the output's
    type (``TransformWithStateInPySparkRowSerializer``, row-based ``transformWithState``).

    Consecutive DataFrames with the same columns and column types, none of them Python objects,
    are converted together (what each gives is the same, its values typed by its column; one
    conversion costs about what one DataFrame's does, and a processor often yields one row per
    call); if that fails, each is converted alone, so an error is pyspark's for its frame."""

    def __init__(self, inst: "ProcessorInstance"):
        self.inst = inst
        self.batches: List[pa.RecordBatch] = []
        self.rows: list = []
        self.frames: list = []  # (DataFrames of one signature, not converted yet)
        self.signature = None

    def add(self, item) -> None:
        import pandas as pd
        from pyspark.errors import PySparkTypeError

        inst = self.inst
        want = Row if inst.use_rows else pd.DataFrame
        if not isinstance(item, want):
            raise PySparkTypeError(
                errorClass="UDF_RETURN_TYPE",
                messageParameters={"expected": f"iterator of {want.__name__}",
                                   "actual": "iterator of {}".format(type(item).__name__)})
        if inst.use_rows:
            self.rows.append(item.asDict(True))
        elif len(item) > 0:
            sig = _signature(item)
            if sig is None or sig != self.signature:
                self._flush()
            self.frames.append(item)
            self.signature = sig
            if sig is None:
                self._flush()

    def _flush(self) -> None:
        frames, self.frames, self.signature = self.frames, [], None
        if len(frames) > 1:
            try:
                self.batches.append(to_arrow(self.inst, _concat(frames)))
                return
            except Exception:  # noqa: BLE001 (each alone: pyspark's error for its frame)
                pass
        self.batches.extend(to_arrow(self.inst, f) for f in frames)

    def finish(self) -> List[pa.RecordBatch]:
        self._flush()
        if self.rows:
            self.batches.append(pa.RecordBatch.from_pylist(self.rows,
                                                           schema=self.inst.row_schema))
            self.rows = []
        return self.batches


def _signature(frame) -> Optional[tuple]:
    """A DataFrame's columns and their types, if none holds Python objects (whose conversion
    may depend on the other values of the column); else None."""
    dtypes = tuple(frame.dtypes)
    if any(getattr(d, "kind", "O") == "O" and str(d) not in ("str", "string") for d in dtypes):
        return None
    return tuple(frame.columns), dtypes


def _concat(frames):
    """DataFrames of one signature as one, each column one Arrow chunk where it is Arrow-backed
    (pyspark's conversion takes an array, not a chunked one)."""
    import pandas as pd

    out = pd.concat(frames, ignore_index=True)
    for i, dt in enumerate(out.dtypes):
        if hasattr(out.iloc[:, i].array, "__arrow_array__"):
            out.isetitem(i, out.iloc[:, i].astype(object).astype(dt))
    return out


class ProcessorInstance(Instance):
    """Runs the user's ``StatefulProcessor`` for the keys of the buckets this instance owns
    (see the module doc)."""

    def __init__(self, init: I.Init):
        super().__init__(init)
        from pyspark.sql.types import _parse_datatype_json_string

        self._processor_bytes = init.func
        self.time_mode = self.spec.time_mode
        self._schemas = {text: _parse_datatype_json_string(js)
                         for text, js in self.spec.state_schemas.items()}
        self._codecs: Dict[str, Codec] = {}
        self.current: Optional[KeyState] = None
        self.dropped: Dict[str, int] = {}
        self.schemas: List[str] = []  # (the query's state schemas, Spark JSON, numbered)
        self.batch_no = -1
        self.uses_ttl = False  # (a variable of this batch's processor has a TTL)
        self.counts: Counter = Counter()  # (this step's, as Spark's customMetrics)
        self.var_schemas: Dict[str, str] = {}  # (variable -> its value schema, Spark JSON)
        self.avro = self.spec.runner_conf.get("state_encoding", "unsaferow") == "avro"
        self.use_rows = self.spec.api == "transformWithState"  # (else ...InPandas)
        if self.use_rows:
            from pyspark.sql.pandas.types import to_arrow_type

            self.row_schema = pa.schema(list(to_arrow_type(self.out_schema, timezone="UTC",
                                                           prefers_large_types=False)))

    def count(self, metric: str, n: int = 1) -> None:
        """Add ``n`` to this step's ``metric`` (Spark's name: ``numRegisteredTimers``, ...)."""
        self.counts[metric] += n

    def operator_metrics(self) -> dict:
        return dict(self.counts)

    def drop(self, name: str) -> None:
        """``deleteIfExists(name)``: every key's value of it written before this batch is
        gone."""
        if self.dropped.get(name) != self.batch_no:
            self.dropped[name] = self.batch_no
            self._save_variables()

    def _save_variables(self) -> None:
        """The query's dropped variables and state schemas, under the reserved key
        :data:`VARIABLES` (each instance of a batch writes the same: its processor's ``init``
        is the same)."""
        self.step.put(VARIABLES, (None, {"dropped": dict(self.dropped),
                                         "schemas": list(self.schemas),
                                         "variables": dict(self.var_schemas)}, ()))

    def _load_variables(self) -> None:
        e = self.step.get(VARIABLES)
        got = e[1] if e is not None else {}
        self.dropped = dict(got.get("dropped", {}))
        self.schemas = list(got.get("schemas", []))
        self.var_schemas = dict(got.get("variables", {}))

    def declare(self, name: str, schema: StructType) -> None:
        """State variable ``name`` with value schema ``schema`` in this batch: checked against
        the one its checkpoint has, as Spark checks it (:mod:`.schemas`), then kept."""
        from .schemas import check_evolution, check_nullable

        if self.avro:
            check_nullable(name, schema)
        js = schema.json()
        old = self.var_schemas.get(name)
        if old == js:
            return
        if old is not None:
            check_evolution(name, self._parse(old), schema, self.avro)
        self.var_schemas[name] = js
        self._save_variables()

    def codec(self, schema) -> Codec:
        if isinstance(schema, str):
            parsed = self._schemas.get(schema)
            if parsed is None:
                raise PySparkRuntimeError(
                    f"state schema {schema!r} was not seen when the driver ran the processor's "
                    "init; give it as a StructType")
            schema = parsed
        if not isinstance(schema, StructType):
            raise PySparkRuntimeError(f"a state schema is a StructType or DDL text, got "
                                      f"{type(schema).__name__}")
        js = schema.json()
        if js not in self.schemas:  # (a schema new to the query: numbered, kept)
            self.schemas.append(js)
            self._save_variables()
        c = self._codecs.get(js)
        if c is None:
            c = self._codecs[js] = Codec(schema, self.schemas.index(js), self._schema_of)
        return c

    def _schema_of(self, sid: int) -> StructType:
        return self._parse(self.schemas[sid])

    @staticmethod
    def _parse(js: str) -> StructType:
        from pyspark.sql.types import _parse_datatype_json_string

        return _parse_datatype_json_string(js)

    def _rows_per_frame(self, table: pa.Table) -> int:
        """How many of a key's rows pyspark puts in one DataFrame: maxRecordsPerBatch, or fewer
        where their Arrow bytes at the average row size reach maxBytesPerBatch (natively the
        average over the JVM's Arrow batches; here the table's)."""
        max_bytes = int(self.spec.runner_conf.get("arrow_max_bytes_per_batch", 2 ** 31 - 1))
        if max_bytes >= 2 ** 31 - 1 or not table.num_rows:
            return self.max_records
        per_row = table.nbytes / table.num_rows
        return max(1, min(self.max_records, math.ceil(max_bytes / per_row)))

    def _chunks(self, pdf, a: int, z: int, per: int, cast=None):
        """The key's rows as pyspark's ``TransformWithStateInPandasSerializer`` gives them: the
        rows as tuples, made into DataFrames of at most ``per`` rows (so the column types are
        those pandas infers from the values, as natively). ``cast``: the table with its
        columns cast to the types the tuples give (:meth:`_tuple_table`), so the frames are
        cut from it, not built row by row."""
        import pandas as pd

        for lo in range(a, z, per):
            hi = min(z, lo + per)
            if cast is not None:
                frame = cast.iloc[lo:hi]  # (a new frame: its index is its own)
                frame.index = pd.RangeIndex(hi - lo)
                yield frame
            else:
                yield pd.DataFrame(list(pdf.iloc[lo:hi].itertuples(index=False)))

    def _tuple_table(self, table: pa.Table, pdf, per: int):
        """The table with its columns cast to the types pandas infers for its rows made
        tuples, if that gives the same frames (checked on its first rows): columns without
        nulls, names that stay names in a namedtuple; else None (frames built from the
        tuples)."""
        if table.num_rows == 0 or any(c.null_count for c in table.columns):
            return None
        probe = min(table.num_rows, 64)
        slow = next(self._chunks(pdf, 0, probe, per))
        if list(slow.columns) != list(pdf.columns):
            return None
        try:
            cast = pdf.astype(slow.dtypes.to_dict())  # (once per table: a key's frame a slice)
        except (TypeError, ValueError):
            return None
        return cast if cast.iloc[:len(slow)].reset_index(drop=True).equals(slow) else None

    def _timer_values(self) -> TimerValues:
        if self.time_mode.lower() == "none":
            return TimerValues(-1, -1)
        return TimerValues(self.ts_ms, self.wm_ms if self.spec.ts_column else -1)

    def _open(self, kb: bytes, bucket: int, key: tuple) -> None:
        e = self.step.get(kb)
        self.current = KeyState(kb, bucket, key if e is None else e[0], e)

    def _close_key(self) -> None:
        k, self.current = self.current, None
        if k is None or not k.changed:
            return
        for name, v in list(k.vars.items()):  # (values of dropped variables)
            if v[0] < self.dropped.get(name, -1):
                del k.vars[name]
        first = prune_expired(k.vars, self.ts_ms, self.count)
        timers = tuple(sorted(k.timers)) + (() if first is None else (TTL_TIMERS + first,))
        if k.vars or k.timers:
            self.step.put(k.kb, (k.key, k.vars, timers))
            self.updated += 1
        else:
            self.step.delete(k.kb)
            self.removed += 1
        self.dirty.add(k.bucket)

    def _data_calls(self, msg: I.Batch):
        from pyspark import cloudpickle

        self.processor = cloudpickle.loads(self._processor_bytes)  # (a fresh one per batch)
        self.current = None
        self.batch_no = int(msg.batch)
        self.uses_ttl = False
        self.counts = Counter()
        self._load_variables()
        self._codecs.clear()  # (numbered by this store's list of schemas)
        self.processor.init(StoreHandle(self))
        out = _Output(self)
        calls = 0
        tv = self._timer_values()
        initial = self._initial_groups(msg)  # (store key -> the key, its bucket, its values)
        if msg.input:
            table = pa.ipc.open_file(pa.memory_map(msg.input)).read_all()
            starts = np.asarray(msg.starts, dtype=np.int64)
            ends = np.append(starts[1:], table.num_rows)
            gb = msg.group_buckets
            key_at, values_of = self._groups(table, self.key_columns, self.columns)
            for g in range(len(starts)):
                a, z = int(starts[g]), int(ends[g])
                key, b = key_at(a), int(gb[g])
                kb = encode_key(b, key)
                self._open(kb, b, key)
                if kb in initial:  # (the first batch: its initial state before its rows)
                    self._initial_state(*initial.pop(kb)[::2], tv)
                for res in self.processor.handleInputRows(key, values_of(a, z), tv):
                    out.add(res)
                self._close_key()
                calls += 1
        for kb, (key, b, values) in initial.items():  # (keys with initial state, no rows)
            self._open(kb, b, key)
            self._initial_state(key, values, tv)
            self._close_key()
        return out.finish(), calls

    def _groups(self, table: pa.Table, keys: List[str], columns: List[str]):
        """``(key_at(row), values_of(first, end))`` of a table sorted by key: the key of a row
        and the values of a key's rows, as pyspark's serializers give them (the row-based ones:
        Arrow's ``as_py``; the pandas ones: pandas' values)."""
        if self.use_rows:
            cols = [table.column(k) for k in keys]
            return (lambda a: tuple(c[a].as_py() for c in cols)), self._rows(table, keys,
                                                                              columns)
        pdf = self._to_pandas(table)
        kvals = [pdf.iloc[:, columns.index(k)]._values for k in keys]
        per = self._rows_per_frame(table)  # (each table its own: initialState's is read first)
        cast = self._tuple_table(table, pdf, per)
        return ((lambda a: tuple(normalize(v[a]) for v in kvals)),
                (lambda a, z: self._chunks(pdf, a, z, per, cast)))

    def _initial_groups(self, msg: I.Batch) -> dict:
        """The first step's initial state per key (``initialState``): store key -> ``(key,
        bucket, its values)``, in key order."""
        if not msg.initial:
            return {}
        table = pa.ipc.open_file(pa.memory_map(msg.initial)).read_all()
        starts = np.asarray(msg.initial_starts, dtype=np.int64)
        ends = np.append(starts[1:], table.num_rows)
        key_at, values_of = self._groups(table, list(self.spec.initial_key_columns),
                                         table.column_names)
        groups = {}
        for g in range(len(starts)):
            a, z = int(starts[g]), int(ends[g])
            key, b = key_at(a), int(msg.initial_buckets[g])
            groups[encode_key(b, key)] = (key, b, values_of(a, z))
        return groups

    def _initial_state(self, key: tuple, values, tv) -> None:
        """``handleInitialState`` for each of the key's initial DataFrames (pandas) or Rows."""
        for v in values:
            self.processor.handleInitialState(key, v, tv)

    def _rows(self, table: pa.Table, keys: List[str], columns: List[str]):
        """The rows of a key for row-based ``transformWithState``, as pyspark's
        ``TransformWithStateInPySparkRowSerializer`` makes them: Rows of the grouping columns
        then the other columns, values by Arrow's ``as_py``."""
        names = keys + [c for c in columns if c not in keys]
        data_row = Row(*names)
        cols = [table.column(n) for n in names]

        def rows_of(a: int, z: int):
            return iter([data_row(*v) for v in zip(*(c.slice(a, z - a).to_pylist()
                                                     for c in cols))])
        return rows_of

    def _timeout_calls(self, owned: List[int]):
        out = _Output(self)
        tcalls = 0
        mode = self.time_mode.lower()
        if mode != "none":
            t0 = time.perf_counter()
            threshold = self.ts_ms if mode == "processingtime" else self.wm_ms
            # (a timer at the threshold fires: TimerStateImpl's expiry is inclusive)
            due = sorted((ts, kb, b) for b in owned
                         for ts, kb in self.step.due_timers(b, threshold + 1))
            tv = self._timer_values()
            for ts, kb, b in due:
                e = self.step.get(kb)
                if e is None or ts not in e[2]:
                    continue  # (deleted by an earlier call of this batch)
                self._open(kb, b, e[0])
                for res in self.processor.handleExpiredTimer(e[0], tv, ExpiredTimerInfo(ts)):
                    out.add(res)
                self.count("numExpiredTimers")
                self.current.timers.discard(ts)
                self.current.changed = True
                self._close_key()
                tcalls += 1
            self.count("timerProcessingTimeMs", round((time.perf_counter() - t0) * 1e3))
        if self.uses_ttl:
            self._drop_expired(owned)
        self.processor.close()
        return out.finish(), tcalls

    def _drop_expired(self, owned: List[int]) -> None:
        """The batch's end, as Spark's ``clearExpiredState``: the keys of the owned buckets
        whose state has expired by the batch's timestamp (their earliest expiry, a timer above
        :data:`TTL_TIMERS`, is due) written back without it."""
        for b in owned:
            for ts, kb in self.step.due_timers(b, TTL_TIMERS + self.ts_ms + 1, since=TTL_TIMERS):
                e = self.step.get(kb)
                if e is None or ts not in e[2]:
                    continue
                self._open(kb, b, e[0])
                self.current.changed = True
                self._close_key()
