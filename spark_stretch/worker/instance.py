"""One instance process of the ``applyInPandasWithState`` drop-in: the user's function per key.

Started by the host engine (:mod:`spark_stretch.host.instances`) as ``python -m
spark_stretch.worker``; it gets :class:`~spark_stretch.protocol.instances.Init`, then one
:class:`~spark_stretch.protocol.instances.Batch` per step, on its socket. Like pyspark's own
executor-side worker (``pyspark/sql/worker/``), it uses pyspark's pure-Python modules (the
``GroupState`` class, the Arrow <-> pandas conversion, cloudpickle) so that the function sees
exactly what it sees under native Spark; it never starts or talks to a JVM.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import numpy as np
import pyarrow as pa

from ..engine.keyed import NO_TIMEOUT as NO_TIMESTAMP
from ..engine.keyed import KeyedStore, Step, encode_key, memory_share, write_changelog
from ..protocol import instances as I
from .output import OutputBuffer

__all__ = ["Instance", "NO_TIMESTAMP", "PROFILE_ENV"]

# A directory: each step of each instance profiled there (cProfile), for finding where a
# drop-in's batch goes.
PROFILE_ENV = "SPARK_STRETCH_PROFILE_DIR"


class Instance:
    """Runs the user's function for the keys of the buckets this instance owns.

    Per batch, as ``FlatMapGroupsInPandasWithStateExec`` does per partition:

    1. every key with data, once, in key order: ``func(key, iter([pdf, ...]), state)``, the data
       converted with pyspark's own Arrow-to-pandas code (session time zone, same dtypes), in
       chunks of ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows;
    2. then every key of the owned buckets whose timeout timestamp is set and earlier than the
       threshold (the batch timestamp for ``ProcessingTimeTimeout``, the batch's event-time
       watermark for ``EventTimeTimeout``), keys that had data included, with
       ``hasTimedOut=True`` and ``[empty pdf]`` as the data.

    The state object is pyspark's ``GroupState``, built as the JVM builds it for Python
    (``GroupStateImpl.createForStreaming``): the stored value, the batch timestamp, the eviction
    watermark, and *no* timeout (``timeoutTimestamp=-1``; the stored timeout is not carried in).
    After the call Spark's rules decide what is stored: removed and no timeout set -> the key is
    deleted; else the value (or none) and the new timeout are written if the state was updated,
    removed or a timeout was set. A key whose function touched nothing keeps its old value *and
    old timeout* (so a timed-out key that neither sets a timeout nor removes its state times out
    again in the next batch, as in Spark).
    """

    def __init__(self, init: I.Init):
        from pyspark import cloudpickle
        from pyspark.sql.types import StructType, _parse_datatype_json_string

        s = init.spec
        self.spec = s
        self.index = init.index
        self.shm = Path(init.shm)
        self.func = cloudpickle.loads(init.func)
        self.out_schema = _parse_datatype_json_string(s.out_schema)
        self.state_schema: StructType = _parse_datatype_json_string(s.state_schema)
        self.state_needs_conversion = any(f.dataType.needConversion()
                                          for f in self.state_schema.fields)
        rc = s.runner_conf
        self.tz = rc.get("timezone")
        self.safecheck = rc.get("safecheck", False)
        self.assign_cols_by_name = rc.get("assign_cols_by_name", True)
        self.prefer_int_ext_dtype = rc.get("prefer_int_ext_dtype", False)
        self.int_to_decimal = rc.get("int_to_decimal_coercion_enabled", False)
        mr = int(rc.get("arrow_max_records_per_batch", 10000))
        self.max_records = mr if mr > 0 else 2 ** 31 - 1
        self.columns = list(s.columns)
        self.key_columns = list(s.key_columns)
        self.timeout_conf = s.timeout_conf
        self.watermark_present = s.watermark_present
        self.kv = KeyedStore(init.state, memory_share(s))
        self.step: Optional[Step] = None

    def reset(self) -> None:
        """Drop a half-run step (nothing of it was committed)."""
        if self.step is not None:
            self.step.abort()
            self.step = None

    # -- one batch ---------------------------------------------------------------------------
    def batch(self, msg: I.Batch) -> I.BatchDone:
        prof_dir = os.environ.get(PROFILE_ENV)
        if not prof_dir:
            return self._batch(msg)
        import cProfile  # (a developer's aid: each step's profile, python/bench's --profile)

        with cProfile.Profile() as prof:
            reply = self._batch(msg)
        prof.dump_stats(os.path.join(prof_dir, f"instance{self.index}-step{msg.seq}.prof"))
        return reply

    def _batch(self, msg: I.Batch) -> I.BatchDone:
        t0 = time.perf_counter()
        done = self.kv.applied(self.index, msg.seq)
        if done is not None:  # this process's predecessor applied the step, then died
            return done
        owned = sorted(int(b) for b in msg.owned)
        self.step = self.kv.step()
        self.dirty = set()
        self.updated = self.removed = 0  # (keys whose state was written, or deleted)
        self.ts_ms = int(msg.batch_ts_ms)
        self.wm_ms = int(msg.watermark_ms)
        batches, calls = self._data_calls(msg)
        t1 = time.perf_counter()
        more, tcalls = self._timeout_calls(owned)
        batches += more
        t2 = time.perf_counter()
        rows = sum(x.num_rows for x in batches)
        # (no rows: an empty file of the output's columns, which the engine offers when no
        # instance has rows, for Spark reads every host's output of a batch)
        out_path = str(I.output_file(self.shm, msg.seq, self.index))
        with pa.OSFile(out_path, "wb") as f:
            with pa.ipc.new_file(f, batches[0].schema if batches else self._out_arrow()) as w:
                for rb in batches:
                    w.write_batch(rb)
        log = self.step.changelog()
        changes = None
        if log.num_rows:  # the step's changelog: the engine's incremental checkpoint
            changes = str(I.changes_file(self.shm, msg.seq, self.index))
            write_changelog(changes, log)
        t3 = time.perf_counter()
        reply = I.BatchDone(out=out_path, rows=rows, dirty=sorted(self.dirty), calls=calls,
                            timeout_calls=tcalls, changes=changes, changed_rows=log.num_rows,
                            updated=self.updated, removed=self.removed,
                            operator=self.operator_metrics(),
                            times={"data_ms": (t1 - t0) * 1e3, "timeouts_ms": (t2 - t1) * 1e3,
                                   "write_ms": (t3 - t2) * 1e3})
        self.step.commit(self.index, msg.seq, reply, log)
        self.step = None
        # (the store's pages it keeps mapped, after the commit dropped them past its share)
        return replace(reply, held=self.kv.held())

    def operator_metrics(self) -> dict:
        """The step's counters of the operator (none for applyInPandasWithState)."""
        return {}

    def _data_calls(self, msg: I.Batch):
        """Every key with data, once, in key order: the output's batches and the calls."""
        batches: List[pa.RecordBatch] = []
        calls = 0
        if msg.input:
            table = pa.ipc.open_file(pa.memory_map(msg.input)).read_all()
            pdf = self._to_pandas(table)
            starts = np.asarray(msg.starts, dtype=np.int64)
            ends = np.append(starts[1:], len(pdf))
            gb = msg.group_buckets
            kidx = [self.columns.index(k) for k in self.key_columns]
            kvals = [pdf.iloc[:, j]._values for j in kidx]
            out = OutputBuffer(self)
            for g in range(len(starts)):
                a, z = int(starts[g]), int(ends[g])
                key = tuple(v[a] for v in kvals)
                b = int(gb[g])
                values = self._chunks(pdf, a, z)
                self._call(key, encode_key(b, key), values, b, False, out)
                calls += 1
            batches += out.finish()
        return batches, calls

    def _timeout_calls(self, owned: List[int]):
        """Every key of the owned buckets whose timeout passed: the output's batches and the
        calls."""
        import pandas as pd

        if self.timeout_conf == "NoTimeout":
            return [], 0
        threshold = self.ts_ms if self.timeout_conf == "ProcessingTimeTimeout" else self.wm_ms
        empty = None
        tcalls = 0
        out = OutputBuffer(self)
        for b in owned:
            for kb in self.step.due(b, threshold):
                if empty is None:
                    empty = pd.DataFrame(columns=self.columns)
                # as pyspark's wrapper: a list with one empty DataFrame of the data columns
                self._call(self.step.get(kb)[0], kb, [empty], b, True, out)
                tcalls += 1
        return out.finish(), tcalls

    def _to_pandas(self, table: pa.Table):
        import pandas as pd
        from pyspark.sql.conversion import ArrowBatchTransformer

        series = ArrowBatchTransformer.to_pandas(
            table, timezone=self.tz, schema=None, struct_in_pandas="dict", ndarray_as_list=False,
            prefer_int_ext_dtype=self.prefer_int_ext_dtype, df_for_struct=False)
        pdf = pd.concat(series, axis=1)
        # Native converts each group's rows on their own: an integer column with nulls elsewhere
        # in the batch must not turn float for a group without nulls. Keep such tables per group.
        self._per_group = None
        for i, f in enumerate(table.schema):
            t = f.type
            if (pa.types.is_integer(t) or pa.types.is_boolean(t)) and table.column(i).null_count:
                self._per_group = table
                break
        return pdf

    def _chunks(self, pdf, a: int, z: int):
        """The group's rows as pandas DataFrames of at most maxRecordsPerBatch rows."""
        import pandas as pd

        out = []
        for lo in range(a, z, self.max_records):
            hi = min(z, lo + self.max_records)
            if self._per_group is not None:
                out.append(self._to_pandas_exact(self._per_group.slice(lo, hi - lo)))
            else:
                part = pdf.iloc[lo:hi]
                part.index = pd.RangeIndex(hi - lo)
                out.append(part)
        return iter(out)

    def _to_pandas_exact(self, table: pa.Table):
        import pandas as pd
        from pyspark.sql.conversion import ArrowBatchTransformer

        return pd.concat(ArrowBatchTransformer.to_pandas(
            table, timezone=self.tz, schema=None, struct_in_pandas="dict", ndarray_as_list=False,
            prefer_int_ext_dtype=self.prefer_int_ext_dtype, df_for_struct=False), axis=1)

    def _out_arrow(self) -> pa.Schema:
        """The Arrow schema of the output's columns (pyspark's conversion of its Spark type)."""
        from pyspark.sql.pandas.types import to_arrow_schema

        return to_arrow_schema(self.out_schema, timezone=self.tz)

    def _call(self, key: tuple, kb: bytes, values, b: int, timed_out: bool,
              out: OutputBuffer) -> None:
        """One call of the function, as pyspark's ``wrap_grouped_map_pandas_udf_with_state``,
        then Spark's rules for what is stored."""
        import pandas as pd
        from pyspark.errors import PySparkRuntimeError, PySparkTypeError
        from pyspark.sql.streaming.state import GroupState

        old = self.step.get(kb)
        value = None
        if old is not None and old[1] is not None:
            value = self.state_schema.fromInternal(old[1])
        state = GroupState(
            optionalValue=value, batchProcessingTimeMs=self.ts_ms,
            eventTimeWatermarkMs=self.wm_ms, timeoutConf=self.timeout_conf,
            hasTimedOut=timed_out, watermarkPresent=self.watermark_present,
            defined=value is not None, updated=False, removed=False,
            timeoutTimestamp=NO_TIMESTAMP, keyAsUnsafe=b"", valueSchema=self.state_schema)
        result_iter = self.func(key, values, state)
        if isinstance(result_iter, pd.DataFrame):
            raise PySparkTypeError(
                errorClass="UDF_RETURN_TYPE",
                messageParameters={"expected": "iterable of pandas.DataFrame",
                                   "actual": type(result_iter).__name__})
        try:
            iter(result_iter)
        except TypeError:
            raise PySparkTypeError(
                errorClass="UDF_RETURN_TYPE",
                messageParameters={"expected": "iterable", "actual": type(result_iter).__name__})
        n_out = len(self.out_schema)
        for result in result_iter:
            if not isinstance(result, pd.DataFrame):
                raise PySparkTypeError(
                    errorClass="UDF_RETURN_TYPE",
                    messageParameters={"expected": "iterator of pandas.DataFrame",
                                       "actual": "iterator of {}".format(type(result).__name__)})
            if not (len(result.columns) == n_out or (len(result.columns) == 0 and result.empty)):
                raise PySparkRuntimeError(
                    errorClass="RESULT_COLUMN_SCHEMA_MISMATCH",
                    messageParameters={"expected": str(n_out),
                                       "actual": str(len(result.columns))})
            out.add(result)
        out.state_done()
        # FlatMapGroupsInPandasWithStateExec.process / onIteratorCompletion
        timeout = state._timeout_timestamp
        if state._removed and timeout == NO_TIMESTAMP:
            self.removed += 1  # (counted as native counts them: numRemovedStateRows)
            if old is not None:
                self.step.delete(kb)
                self.dirty.add(b)
        elif state._updated or state._removed or timeout != state.oldTimeoutTimestamp:
            stored = None
            if state.exists:
                v = state._value
                if len(v) != len(self.state_schema.fields):
                    raise PySparkRuntimeError(
                        f"state value {tuple(v)!r} has {len(v)} fields, the state schema "
                        f"{self.state_schema.simpleString()} has {len(self.state_schema.fields)}")
                stored = tuple(self.state_schema.toInternal(v)) if self.state_needs_conversion \
                    else tuple(v)
            self.step.put(kb, (key, stored, int(timeout)))
            self.dirty.add(b)
            self.updated += 1


