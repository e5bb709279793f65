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
``close()``.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
from pyspark.errors import PySparkRuntimeError
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
from pyspark.sql.types import StructType

from ..engine.keyed import encode_key
from ..protocol import instances as I
from .handle import Codec, KeyState, StoreHandle, normalize
from .instance import Instance

__all__ = ["ProcessorInstance", "VARIABLES"]

# The reserved store key of the query's dropped variables (a bucket no query has: B <= 4096)
VARIABLES = (0xFFFF).to_bytes(2, "big") + b"variables"


class _Output:
    """What pyspark's ``TransformWithStateInPandasSerializer.dump_stream`` does with the
    returned DataFrames: each converted on its own with pyspark's conversion (columns by name,
    Arrow casts)."""

    def __init__(self, inst: "ProcessorInstance"):
        self.inst = inst
        self.batches: List[pa.RecordBatch] = []

    def add(self, pdf) -> None:
        import pandas as pd
        from pyspark.sql.conversion import PandasToArrowConversion

        if not isinstance(pdf, pd.DataFrame):
            from pyspark.errors import PySparkTypeError
            raise PySparkTypeError(
                errorClass="UDF_RETURN_TYPE",
                messageParameters={"expected": "iterator of pandas.DataFrame",
                                   "actual": "iterator of {}".format(type(pdf).__name__)})
        if len(pdf) == 0:
            return
        inst = self.inst
        self.batches.append(PandasToArrowConversion.convert(
            pdf, inst.out_schema, timezone=inst.tz, safecheck=inst.safecheck, arrow_cast=True,
            assign_cols_by_name=inst.assign_cols_by_name,
            int_to_decimal_coercion_enabled=inst.int_to_decimal))

    def finish(self) -> List[pa.RecordBatch]:
        return self.batches


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
        self.batch_no = -1

    def drop(self, name: str) -> None:
        """``deleteIfExists(name)``: every key's value of it written before this batch is
        gone (kept under the reserved key :data:`VARIABLES`, which each instance of the batch
        writes alike)."""
        if self.dropped.get(name) != self.batch_no:
            self.dropped[name] = self.batch_no
            self.step.put(VARIABLES, (None, dict(self.dropped), ()))

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
        c = self._codecs.get(js)
        if c is None:
            c = self._codecs[js] = Codec(schema)
        return c

    def _chunks(self, pdf, a: int, z: int):
        """The key's rows as pyspark's ``TransformWithStateInPandasSerializer`` gives them: the
        rows as tuples, made into DataFrames of at most maxRecordsPerBatch rows (so the
        column types are those pandas infers from the values, as natively)."""
        import pandas as pd

        rows = list(pdf.iloc[a:z].itertuples(index=False))
        for lo in range(0, len(rows), self.max_records):
            yield pd.DataFrame(rows[lo:lo + self.max_records])

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
        for name, (written, _) in list(k.vars.items()):  # (values of dropped variables)
            if written < self.dropped.get(name, -1):
                del k.vars[name]
        if k.vars or k.timers:
            self.step.put(k.kb, (k.key, k.vars, tuple(sorted(k.timers))))
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
        e = self.step.get(VARIABLES)
        self.dropped = dict(e[1]) if e is not None else {}
        self.processor.init(StoreHandle(self))
        out = _Output(self)
        calls = 0
        if msg.input:
            table = pa.ipc.open_file(pa.memory_map(msg.input)).read_all()
            pdf = self._to_pandas(table)
            starts = np.asarray(msg.starts, dtype=np.int64)
            ends = np.append(starts[1:], len(pdf))
            gb = msg.group_buckets
            kvals = [pdf.iloc[:, self.columns.index(k)]._values for k in self.key_columns]
            tv = self._timer_values()
            for g in range(len(starts)):
                a, z = int(starts[g]), int(ends[g])
                key = tuple(normalize(v[a]) for v in kvals)
                b = int(gb[g])
                self._open(encode_key(b, key), b, key)
                for res in self.processor.handleInputRows(key, self._chunks(pdf, a, z), tv):
                    out.add(res)
                self._close_key()
                calls += 1
        return out.finish(), calls

    def _timeout_calls(self, owned: List[int]):
        out = _Output(self)
        tcalls = 0
        mode = self.time_mode.lower()
        if mode != "none":
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
                self.current.timers.discard(ts)
                self.current.changed = True
                self._close_key()
                tcalls += 1
        self.processor.close()
        return out.finish(), tcalls
