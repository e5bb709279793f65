"""``stretch(df)`` over ``groupBy(k).transformWithStateInPandas(processor, ...)``.

Oracle: native Spark's ``transformWithStateInPandas`` (RocksDB state, as Spark requires) over the
same file stream (availableNow, one file per micro-batch), both into Delta in append mode,
compared with chispa. The processor keeps a ValueState, a ListState and a MapState per user and
an event-time timer; rescaled, with instance processes killed, and with the engine killed
mid-batch the table is native's.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Iterator

import pandas as pd
import pytest
from chispa import assert_df_equality
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

import spark_stretch
from spark_stretch import FallbackWarning
from spark_stretch.api.frame import StretchFrame
from spark_stretch.host.faults import ENV
from spark_stretch.testing import TWEETS, write_tweets

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
OUT = "user string, start long, end long, n long, lens string, longest long, kind string"
GAP_MS = 5_000


class Sessions(StatefulProcessor):
    """A session per user, closed by an event-time timer GAP_MS after its last event: its
    bounds and count (ValueState), its tweets' lengths (ListState), the longest tweet per minute
    (MapState). ``die`` (a folder): the process kills itself the first time some users with
    state are called (one marker file per user)."""

    def __init__(self, die: str = ""):
        self.die = die

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.session = handle.getValueState("session", "start long, end long, n long")
        self.lens = handle.getListState("lens", "len long")
        self.longest = handle.getMapState("longest", "minute long", "len long")

    def _maybe_die(self, user):
        import zlib

        if self.die and zlib.crc32(user.encode()) % 40 == 0:
            try:
                os.close(os.open(os.path.join(self.die, user), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        start = end = None
        n = 0
        if self.session.exists():
            self._maybe_die(key[0])
            start, end, n = self.session.get()
            self.handle.deleteTimer(end + GAP_MS)
        for pdf in rows:
            ts = pdf["ts"].values.astype("datetime64[ms]").astype("int64").tolist()
            start = min(ts) if start is None else min(start, min(ts))
            end = max(ts) if end is None else max(end, max(ts))
            n += len(ts)
            self.lens.appendList([(int(x),) for x in pdf["len"]])
            for t, x in zip(ts, pdf["len"]):
                minute = t // 60_000
                old = self.longest.getValue((minute,))
                if old is None or old[0] < x:
                    self.longest.updateValue((minute,), (int(x),))
        self.session.update((start, end, n))
        self.handle.registerTimer(end + GAP_MS)
        yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                            "lens": [None], "longest": [None], "kind": ["open"]})

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        start, end, n = self.session.get()
        lens = ",".join(str(x[0]) for x in self.lens.get())
        longest = max(v[0] for _, v in self.longest.iterator())
        assert sorted(k[0] for k in self.longest.keys()) == sorted(
            k[0] for k, _ in self.longest.iterator())
        self.session.clear()
        self.lens.clear()
        self.longest.clear()
        yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                            "lens": [lens], "longest": [longest], "kind": ["closed"]})

    def close(self) -> None:
        pass


def tws(spark, src, processor=None):
    df = (spark.readStream.schema(TWEETS).option("maxFilesPerTrigger", 1).parquet(str(src))
          .withWatermark("ts", "10 seconds"))
    return df.groupBy("user").transformWithStateInPandas(
        processor or Sessions(), OUT, "Append", "EventTime")


def start(df, out, **trigger):
    return (df.writeStream.outputMode("append").format("delta")
            .option("checkpointLocation", str(out) + "-ckpt")
            .trigger(**(trigger or {"availableNow": True})).start(str(out)))


def on_engine(df, **kw):
    kw.setdefault("parallelism", 2)
    kw.setdefault("max_parallelism", 2)
    out = spark_stretch.stretch(df, buckets=64, **kw)
    assert isinstance(out, StretchFrame), "fell back to native Spark"
    return out


def equal(spark, out, want):
    got = spark.read.format("delta").load(str(out))
    assert want.count() > 0
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                       ignore_metadata=True)


@pytest.fixture(scope="module")
def stream(spark, tmp_path_factory):
    """Six one-file micro-batches with late rows, and native's table over them."""
    key = "spark.sql.streaming.stateStore.providerClass"
    spark.conf.set(key, ROCKSDB)
    tmp = tmp_path_factory.mktemp("transform")
    src = write_tweets(tmp / "src", 720, files=6, rate=12.0, users=150, vocab=30,
                       late_fraction=0.04, late_by_s=20.0, jitter_s=4.0, seed=7)
    q = start(tws(spark, src), tmp / "native")
    q.awaitTermination()
    yield src, spark.read.format("delta").load(str(tmp / "native"))
    spark.conf.unset(key)


def test_value_list_map_state_and_timers_equal_native(spark, stream, tmp_path):
    src, want = stream
    q = start(on_engine(tws(spark, src)), tmp_path / "o")
    q.awaitTermination()
    assert q.exception() is None
    equal(spark, tmp_path / "o", want)
    assert want.where("kind = 'closed'").count() > 50  # timers fired, lists and maps read
    m = q.metrics()
    assert m["engine"]["calls"] > 0 and m["engine"]["timeout_calls"] > 50, m["engine"]


@pytest.mark.soak
def test_reconfigure_mid_stream_equals_native(spark, stream, tmp_path):
    src, want = stream
    q = start(on_engine(tws(spark, src), parallelism=1), tmp_path / "o")
    recs = []
    for after, k in ((2, 2), (4, 1)):  # while the query runs: no stop, no restart
        while q.metrics()["batches"] < after:
            assert q.isActive, q.exception()
        recs.append(q.reconfigure(parallelism=k))
    q.awaitTermination()
    assert q.exception() is None
    equal(spark, tmp_path / "o", want)
    assert [r["parallelism"] for r in recs] == [2, 1]
    assert all(r["state_copied_bytes"] == 0 for r in recs), recs


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_killed_instances_rerun_their_share_and_equal_native(spark, stream, tmp_path):
    src, want = stream
    markers = tmp_path / "died"
    markers.mkdir()
    q = start(on_engine(tws(spark, src, Sessions(str(markers)))), tmp_path / "o")
    q.awaitTermination()
    assert q.exception() is None
    equal(spark, tmp_path / "o", want)
    deaths = len(list(markers.iterdir()))
    assert deaths >= 2 and q.metrics()["instance_retries"] == deaths


@pytest.mark.slow  # an engine restart; with -m slow
def test_engine_killed_mid_batch_is_restarted_from_checkpoint(spark, stream, tmp_path,
                                                              monkeypatch):
    src, want = stream
    monkeypatch.setenv(ENV, f"kill@step:3:{tmp_path / 'fired'}")
    q = start(on_engine(tws(spark, src)), tmp_path / "o")
    q.awaitTermination()
    assert (tmp_path / "fired").exists()
    restarts = q.metrics()["engine_restarts"]
    assert len(restarts) == 1 and restarts[0]["resumed_from"] == 2, restarts
    equal(spark, tmp_path / "o", want)


class WithTTL(Sessions):
    def init(self, handle):
        super().init(handle)
        handle.getValueState("seen", "n long", 60_000)


def test_state_ttl_outside_processing_time_falls_back_for_sparks_error(spark, stream):
    """Spark refuses a TTL but in processing time (its error, raised when it runs natively)."""
    src, _ = stream
    q = (spark.readStream.schema(TWEETS).parquet(str(src)).withWatermark("ts", "10 seconds")
         .groupBy("user").transformWithStateInPandas(WithTTL(), OUT, "Append", "EventTime"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = spark_stretch.stretch(q)
    assert out is q
    assert any(issubclass(w.category, FallbackWarning) and "TTL in timeMode EventTime" in str(w.message)
               for w in caught), [str(w.message) for w in caught]


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_elastic_policy_and_control_as_for_the_other_drop_in(spark, stream, tmp_path):
    # stretch(df, elastic=<a user's policy>): two instances after batch 1, every bucket to
    # instance 1 after batch 3 (ownership only); control(q) beside it; stateOperators as
    # Spark's; the table equal to native's
    from .test_elastic import _ScaleOutThenRebalance

    src, want = stream
    policy = _ScaleOutThenRebalance()
    q = start(on_engine(tws(spark, src), parallelism=1, elastic=policy), tmp_path / "o")
    q.awaitTermination()
    assert q.exception() is None
    equal(spark, tmp_path / "o", want)
    c = spark_stretch.control(q)
    recs = c.metrics()["reconfigurations"]
    assert [(r["cause"], r["parallelism"]) for r in recs] == \
        [("scale_out", 2), ("rebalance", 2)], recs
    assert all(r["state_copied_bytes"] == 0 for r in recs)
    assert policy.seen[:5] == list(range(1, 6))  # (not the first batch with input: ElasticRun)
    op = q.lastProgress["stateOperators"][0]
    assert op["numRowsTotal"] == c.metrics()["engine"]["state_keys"] > 0, op
