"""transformWithStateInPandas natively against ``stretch(df)``: sessionization with a ValueState,
a ListState and an event-time timer per key, side by side in one run; and the cost of one
state call on each side.

    python python/bench/transform.py [--events 1000000] [--users 100000] [--files 10]
                                     [--state-calls 2000] [--json] [--no-native]

The same parquet stream (``--files`` files = micro-batches, ``availableNow``, local[2]) of events
``(ts, user, value)`` goes through ``groupBy("user").transformWithStateInPandas(Sessions(),
..., "Append", "EventTime")``: per user a ValueState (session start, end, events), a ListState
(each event's time and value) and an event-time timer at the session's end plus the gap; when
the timer fires, the session's row (with the sum of its list) is emitted and its state cleared.
Native Spark runs it with its RocksDB state store (as it requires), ``stretch(df)`` on 2 instance
processes; both write to Delta (native: Spark's Delta sink; stretch: the engine's own append).
The tables are checked equal (exceptAll both ways).

The state call: a processor that, for each of 200 keys with one row each, calls
``get``/``update`` of a ValueState ``--state-calls`` times (the engine: 20 times as many),
against the same processor with no calls, each side warmed up by a first run; the difference
over the calls made is one call's cost. ``--events 0``: the state call only.

Fair set-up for native Spark: local[2], spark.driver.memory=4g, spark.sql.shuffle.partitions=2
(one per core), RocksDB (Spark's requirement for transformWithState).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

import spark_stretch
from grouped import SCHEMA, equal_tables, write_events  # (python/bench/grouped.py: the same event stream)
from spark_stretch.api.frame import StretchFrame
from workdir import bench_run

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

OUT = "user string, start long, end long, n long, total long"
GAP_MS = 30_000
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


class Sessions(StatefulProcessor):
    """A session per user closes GAP_MS of event time after its last event (an event-time
    timer); its events are kept in a list until then."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.session = handle.getValueState("session", "start long, end long, n long")
        self.events = handle.getListState("events", "ts long, value long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        start = end = None
        n = 0
        if self.session.exists():
            start, end, n = self.session.get()
            self.handle.deleteTimer(end + GAP_MS)
        for pdf in rows:
            ts = pdf["ts"].values.astype("datetime64[ms]").astype(np.int64).tolist()
            lo, hi = min(ts), max(ts)
            start = lo if start is None else min(start, lo)
            end = hi if end is None else max(end, hi)
            n += len(ts)
            self.events.appendList(list(zip(ts, pdf["value"].tolist())))
        self.session.update((start, end, n))
        self.handle.registerTimer(end + GAP_MS)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        start, end, n = self.session.get()
        total = sum(v for _, v in self.events.get())
        self.session.clear()
        self.events.clear()
        yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                            "total": [total]})

    def close(self) -> None:
        pass


class Calls(StatefulProcessor):
    """``calls`` get/update pairs of one ValueState per key."""

    def __init__(self, calls: int):
        self.calls = calls

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        for pdf in rows:
            pass
        c = 0
        for _ in range(self.calls):
            got = self.count.get()
            c = (got[0] if got else 0) + 1
            self.count.update((c,))
        yield pd.DataFrame({"user": [key[0]], "n": [c]})

    def close(self) -> None:
        pass


def source(spark, src):
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
            .withWatermark("ts", "10 seconds"))


def run(spark, df, side: str, out: Path, ckpt: Path) -> float:
    if side == "stretch":
        df = spark_stretch.stretch(df, parallelism=2, max_parallelism=2, buckets=256)
        assert isinstance(df, StretchFrame), "fell back to native Spark"
    t0 = time.perf_counter()
    q = (df.writeStream.outputMode("append").format("delta")
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start(str(out)))
    q.awaitTermination()
    return time.perf_counter() - t0


def state_call(spark, tmp: Path, calls: int) -> dict:
    """One ValueState get + update pair's cost on each side (see the module doc)."""
    src = tmp / "calls-src"
    src.mkdir()
    pq.write_table(pa.table({
        "ts": pa.array(np.arange(200) * 1000, pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
        "user": pa.array([f"k{i:03d}" for i in range(200)]),
        "value": pa.array(np.zeros(200, np.int64))}), src / "a.parquet")
    res = {}
    for side, n in (("native", calls), ("stretch", calls * 20)):  # (each side ~ seconds)
        times = {}
        for i, c in enumerate((0, 0, n)):  # (the first run warms the side up: not counted)
            df = source(spark, src).groupBy("user").transformWithStateInPandas(
                Calls(c), "user string, n long", "Update", "None")
            times[c] = run(spark, df, side, tmp / f"calls-{side}-{i}",
                           tmp / f"calls-{side}-{i}-ckpt")
        res[f"{side}_state_calls"] = 200 * n * 2
        res[f"{side}_state_call_us"] = (times[n] - times[0]) / (200 * n * 2) * 1e6
    res["state_call_ratio"] = res["native_state_call_us"] / res["stretch_state_call_us"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--state-calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-native", action="store_true",
                    help="stretch(df) alone (to profile it: no ratio, no equality check)")
    a = ap.parse_args()
    spark = spark_stretch.session(master="local[2]", conf={
        "spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g",
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB})
    spark.sparkContext.setLogLevel("ERROR")
    with bench_run("bench-transform-") as bench:
        tmp = bench.path
        bench.session(spark)
        res = {"events": a.events, "users": a.users, "files": a.files}
        src = write_events(tmp / "src", a.events, a.users, a.files)
        sides = ("stretch",) if a.no_native else ("native", "stretch")
        for side in sides if a.events else ():
            df = source(spark, src).groupBy("user").transformWithStateInPandas(
                Sessions(), OUT, "Append", "EventTime")
            res[f"{side}_s"] = run(spark, df, side, tmp / side, tmp / f"{side}-ckpt")
            res[f"{side}_events_per_s"] = a.events / res[f"{side}_s"]
        if a.events and a.no_native:
            res["rows"] = spark.read.format("delta").load(str(tmp / "stretch")).count()
            print("RESULT " + json.dumps(res), flush=True)
        elif a.events:
            nat = spark.read.format("delta").load(str(tmp / "native"))
            got = spark.read.format("delta").load(str(tmp / "stretch"))
            res["rows"] = nat.count()
            res["equal"] = equal_tables(nat, got, res["rows"])
            res["throughput_ratio"] = res["native_s"] / res["stretch_s"]
            print("RESULT " + json.dumps(res), flush=True)
        if a.state_calls:
            res.update(state_call(spark, tmp, a.state_calls))
    if a.json or not a.events or a.no_native:
        print(json.dumps(res))
        return
    print(f"sessions (ValueState + ListState + event-time timer) over {a.events:,} events, "
          f"{a.users:,} users, {a.files} batches: {res['rows']:,} sessions, equal: "
          f"{res['equal']}")
    print(f"  native transformWithStateInPandas: {res['native_s']:8.1f} s "
          f"{res['native_events_per_s']:10,.0f} events/s")
    print(f"  stretch(df), 2 instances:          {res['stretch_s']:8.1f} s "
          f"{res['stretch_events_per_s']:10,.0f} events/s   ratio "
          f"{res['throughput_ratio']:.2f}x")
    if "state_call_ratio" in res:
        print(f"  one ValueState get or update: native {res['native_state_call_us']:.1f} us, "
              f"stretch {res['stretch_state_call_us']:.2f} us "
              f"({res['state_call_ratio']:.0f}x)")


if __name__ == "__main__":
    main()
