"""``stretch(df)`` over ``df.groupBy(...).transformWithStateInPandas(processor, ...)``: Spark 4's
``StatefulProcessor`` on the engine.

The query is the user's, unchanged: Spark plans its own ``TransformWithStateInPySparkExec``
(state schema checks, batch time, watermarks, no-data batches, as natively) under the stretch
marker and never runs it; the engine's instance processes run the processor
(:mod:`spark_stretch.worker.processor`) with its state in the host's store, next to them, so a
state call is no round trip to a JVM. What the engine does not run yet falls back to native
Spark with a :class:`~spark_stretch.FallbackWarning` naming the reason.
"""

from __future__ import annotations

import base64
import uuid
from typing import Optional

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from ..driver import jvm
from ..driver.cluster import engine_hosts
from ..driver.inplan import Marked, fall_back, handler_for
from ..driver.routing import BUCKET, bucket_column
from ..protocol.specs import GroupedSpec
from .frame import StretchFrame
from .grouped import _runner_conf, _settle, check_key_groups, watermark_of

__all__ = ["stretch_transform"]

_INITIAL_MAX_BYTES = 256 << 20  # (an initialState travels in the query's spec)

# TimeMode's names in Spark's plan -> the timeout the drop-in's runtime uses for late rows and
# no-data batches (the same rules as applyInPandasWithState's) and the time mode's name in pyspark
_TIME_MODES = {"NoTime": ("NoTimeout", "None"),
               "ProcessingTime": ("ProcessingTimeTimeout", "ProcessingTime"),
               "EventTime": ("EventTimeTimeout", "EventTime")}


class _Recorder:
    """A handle for running the processor's ``init`` on the driver (as Spark does, to learn its
    state variables): it notes the schemas given as DDL text, and what the engine cannot run."""

    def __init__(self, time_mode: str):
        self.schemas = []
        self.unsupported: Optional[str] = None
        self._time_mode = time_mode

    def _note(self, *schemas, ttl=None):
        for s in schemas:
            if isinstance(s, str):
                self.schemas.append(s)
        # (misuse Spark refuses, with its own error, when the query runs natively)
        if ttl is not None and self.unsupported is None:
            if self._time_mode != "ProcessingTime":
                self.unsupported = (f"a state TTL in timeMode {self._time_mode} (Spark's "
                                    "STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL)")
            elif int(ttl) <= 0:
                self.unsupported = ("a state TTL not above zero (Spark's "
                                    "STATEFUL_PROCESSOR_TTL_DURATION_MUST_BE_POSITIVE)")

    def getValueState(self, stateName, schema, ttlDurationMs=None):  # noqa: N802
        self._note(schema, ttl=ttlDurationMs)

    def getListState(self, stateName, schema, ttlDurationMs=None):  # noqa: N802
        self._note(schema, ttl=ttlDurationMs)

    def getMapState(self, stateName, userKeySchema, valueSchema,  # noqa: N802
                    ttlDurationMs=None):
        self._note(userKeySchema, valueSchema, ttl=ttlDurationMs)

    def deleteIfExists(self, stateName):  # noqa: N802
        pass

    def registerTimer(self, expiryTimestampMs):  # noqa: N802
        pass

    def deleteTimer(self, expiryTimestampMs):  # noqa: N802
        pass

    def listTimers(self):  # noqa: N802
        return iter([])


def _pandas_state(df: DataFrame, plans, info: dict, parallelism: int, max_parallelism: int,
                  buckets: int, policy) -> DataFrame:
    """``groupBy(...).applyInPandasWithState(...)`` as written for Spark: the drop-in
    (:func:`~spark_stretch.api.grouped.stretch_apply_in_pandas_with_state`) with the plan's
    function and arguments over the DataFrame it groups; ``df`` with a ``FallbackWarning`` if
    it groups by expressions."""
    from pyspark.sql.types import _parse_datatype_json_string

    from .grouped import stretch_apply_in_pandas_with_state

    if not info["ok"]:
        fall_back(df.sparkSession, f"{info['reason']}: not on the engine yet", stacklevel=4)
        return df
    data = plans.transform_input(df)
    return stretch_apply_in_pandas_with_state(
        data.groupBy(*info["grouping"]), _function_of(base64.b64decode(info["command"])),
        df.schema, _parse_datatype_json_string(info["state_schema"]), info["output_mode"],
        info["timeout"], parallelism=parallelism, max_parallelism=max_parallelism,
        buckets=buckets, elastic=policy)


def _tws_runner_conf(spark) -> dict:
    """What Spark's transformWithState runner gives pyspark's worker: the pandas settings,
    ``maxRecordsPerBatch`` and ``maxBytesPerBatch`` (the key's rows cut by both; Spark's
    ``...transformWithStateInPandas.maxRecordsPerBatch`` sizes only the JVM's Arrow batches)."""
    c = spark.conf
    return {**_runner_conf(spark),
            "arrow_max_bytes_per_batch": int(c.get("spark.sql.execution.arrow.maxBytesPerBatch",
                                                   str(2 ** 31 - 1))),
            "state_encoding": c.get("spark.sql.streaming.stateStore.encodingFormat",
                                    "unsaferow").lower()}


def _function_of(command: bytes):
    """The Python function of a pickled command of Spark's plan (pyspark pickles
    ``(function, returnType)``, broadcast when over 1 MB)."""
    from pyspark.broadcast import Broadcast
    from pyspark.serializers import CloudPickleSerializer

    ser = CloudPickleSerializer()
    got = ser.loads(command)
    if isinstance(got, Broadcast):
        got = ser.loads(got.value)
    return got[0] if isinstance(got, tuple) else got


def _processor_of(command: bytes):
    """The ``StatefulProcessor`` in the pickled function of Spark's plan (pyspark's is
    ``TransformWithStateInPandasUdfUtils(...).transformWithStateUDF``)."""
    utils = getattr(_function_of(command), "__self__", None)
    proc = getattr(utils, "_stateful_processor", None)
    if proc is None:
        raise ValueError("no StatefulProcessor in the plan's function (pyspark changed?)")
    return proc


def _initial_state(spark, plans, df: DataFrame, info: dict, buckets: int):
    """The ``initialState``'s rows for the engine (Arrow IPC, base64; "" if none), or why they
    cannot go there: it is a batch DataFrame, read once here and handed to the engine, which
    gives each key's rows to ``handleInitialState`` in the query's first batch."""
    if not info.get("initial"):
        return "", None
    init = plans.transform_input(df, initial=True)
    if engine_hosts(spark):  # (each host keeps the rows of its key groups' buckets)
        init = init.withColumn(BUCKET, bucket_column(info["initial_grouping"], buckets))
    table = init.toArrow()
    if table.nbytes > _INITIAL_MAX_BYTES:
        return "", (f"an initialState of {table.nbytes:,} bytes (more than "
                    f"{_INITIAL_MAX_BYTES:,} in Arrow)")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode(), None


def stretch_transform(df: DataFrame, parallelism: int, max_parallelism: int, buckets: int,
                      policy) -> Optional[DataFrame]:
    """``df`` on the engine if its last stateful step is a ``transformWithStateInPandas`` (the
    frame, the row-by-row steps after it kept; or ``df`` itself with a ``FallbackWarning`` when
    the engine cannot run it); None if it is not one (``stretch`` reads it as an aggregation
    then)."""
    from pyspark import cloudpickle

    spark = df.sparkSession
    plans = jvm.ShimPlans(spark)
    info = plans.transform_info(df)
    if info.get("pandas_state"):
        return _pandas_state(df, plans, info, parallelism, max_parallelism, buckets, policy)
    if not info.get("tws"):
        return None
    reason = None if info["ok"] else info["reason"]
    if reason is None and info["output_mode"] not in ("Append", "Update"):
        reason = f"output mode {info['output_mode']}"
    initial = ""
    if reason is None:
        proc = _processor_of(base64.b64decode(info["command"]))
        rec = _Recorder(info["time_mode"])
        cloudpickle.loads(cloudpickle.dumps(proc)).init(rec)  # (a copy: the user's stays as is)
        reason = rec.unsupported
    if reason is None:
        check_key_groups(spark, buckets)
        initial, reason = _initial_state(spark, plans, df, info, buckets)
    if reason is not None:
        fall_back(spark, f"{reason}: not on the engine yet", stacklevel=3)
        return df
    timeout_conf, time_mode = _TIME_MODES[info["time_mode"]]
    data = plans.transform_input(df)
    present, ts_column, delay = watermark_of(data)
    spec = GroupedSpec(
        key_columns=list(info["grouping"]), columns=list(data.columns),
        out_schema=info["out_schema"], state_schema=StructType([]).json(),
        output_mode=info["output_mode"], timeout_conf=timeout_conf, ts_column=ts_column,
        delay_ms=int(delay), watermark_present=present, runner_conf=_tws_runner_conf(spark),
        parallelism=parallelism, max_parallelism=max_parallelism, buckets=buckets,
        func=base64.b64encode(cloudpickle.dumps(proc)).decode(),
        api="transformWithStateInPandas" if info["pandas"] else "transformWithState",
        time_mode=time_mode,
        state_schemas={s: spark._parse_ddl(s).json() for s in rec.schemas},
        initial_state=initial, initial_key_columns=list(info.get("initial_grouping", [])))
    agg_id = uuid.uuid4().hex
    handler_for(spark).add(agg_id, Marked(spec, policy, _settle(spark)))
    out = plans.mark_transform(df, data, agg_id, StretchFrame)
    return out._stretch_init(spec, agg_id, ("append", "update"))
