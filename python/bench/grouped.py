"""applyInPandasWithState vs its stretch drop-in: sessionization, side by side in one run.

    python python/bench/grouped.py [--events 1000000] [--users 100000] [--files 10] [--json]

The same parquet stream (``--files`` files = micro-batches, availableNow, local[2]) of events
``(ts, user, value)`` goes through (1) native ``groupBy("user").applyInPandasWithState(sessions,
..., "Update", EventTimeTimeout)`` written to Delta by ``foreachBatch`` (Delta has no update-mode
sink) and (2) ``groupBy("user").stretchAggregate(<same arguments>)`` into Delta. Outputs are
checked equal (exceptAll both ways). Reported: events per second and the ratio.

Rescale: (a) stretch: the query restarted from its checkpoint (all state restored), then
``reconfigure(parallelism=1)`` and back to 2 while it runs: switch time (owner map swap; no
restart, no state moved); (b) Spark's route: the native query is stopped (it ended), its state
checkpoint repartitioned to 1 partition with ``spark._streamingCheckpointManager.repartition``
(new in Spark 4.2), and restarted: repartition time and restart time. Spark 4.2 repartitions
RocksDB state stores only (``STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_PROVIDER`` for the
default HDFS-backed one); run with ``--rocksdb`` to give the native query RocksDB, or the failure
is reported.

Fair set-up for native Spark: the same session (local[2], spark.driver.memory=4g),
spark.sql.shuffle.partitions=2 (one per core), the default HDFS-backed state store; stretch runs 2
instance processes (parallelism=2), the same parallelism.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.streaming.state import GroupStateTimeout

import spark_stretch

SCHEMA = "ts TIMESTAMP, user STRING, value BIGINT"
OUT = "user string, start long, end long, n long, total long, closed boolean"
STATE = "start long, end long, n long, total long"
GAP_MS = 60_000


def sessions(key, pdfs, state):
    """A session closes GAP_MS of event time after its user's last event."""
    if state.hasTimedOut:
        start, end, n, total = state.get
        state.remove()
        yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                            "total": [total], "closed": [True]})
        return
    start, end, n, total = state.get if state.exists else (None, None, 0, 0)
    for pdf in pdfs:
        ts = pdf["ts"].astype("int64") // 1_000_000
        lo, hi = int(ts.min()), int(ts.max())
        start = lo if start is None else min(start, lo)
        end = hi if end is None else max(end, hi)
        n += len(pdf)
        total += int(pdf["value"].sum())
    state.update((start, end, n, total))
    state.setTimeoutTimestamp(max(end + GAP_MS, state.getCurrentWatermarkMs()))
    yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                        "total": [total], "closed": [False]})


def write_events(folder: Path, n: int, users: int, files: int, rate: float = 1000.0,
                 seed: int = 0) -> Path:
    """``n`` events at ``rate`` per second of event time (2 s of disorder), users uniform."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = pa.array([f"u{u:06d}" for u in range(users)])
    per = -(-n // files)
    for f in range(files):
        k = min(per, n - f * per)
        t = (f * per + np.arange(k)) / rate + rng.uniform(0, 2.0, k)
        pq.write_table(pa.table({
            "ts": pa.array((t * 1e6).astype(np.int64)).cast(pa.timestamp("us", tz="UTC")),
            "user": names.take(pa.array(rng.integers(0, users, k))),
            "value": pa.array(rng.integers(0, 100, k), pa.int64())}),
            folder / f"events-{f:05d}.parquet")
    return folder


def source(spark, src):
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
            .withWatermark("ts", "10 seconds"))


ARGS = (sessions, OUT, STATE, "Update", GroupStateTimeout.EventTimeTimeout)


def run_native(spark, src, out: Path, ckpt: Path) -> float:
    def write(batch, batch_id):
        batch.write.format("delta").mode("append").option("txnAppId", "native") \
            .option("txnVersion", batch_id).save(str(out))

    t0 = time.perf_counter()
    q = (source(spark, src).groupBy("user").applyInPandasWithState(*ARGS).writeStream
         .outputMode("update").foreachBatch(write).option("checkpointLocation", str(ckpt))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(q.exception())
    return time.perf_counter() - t0


def run_stretch(spark, src, out: Path, ckpt: Path, **trigger):
    t0 = time.perf_counter()
    q = (source(spark, src).groupBy("user").stretchAggregate(*ARGS, parallelism=2,
                                                             max_parallelism=2)
         .writeStream.outputMode("update").format("delta")
         .option("checkpointLocation", str(ckpt))
         .trigger(**(trigger or {"availableNow": True})).start(str(out)))
    if trigger:
        return q, t0
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(q.exception())
    return q, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rocksdb", action="store_true",
                    help="native state in RocksDB (needed by Spark's repartition)")
    a = ap.parse_args()
    conf = {"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g"}
    if a.rocksdb:
        conf["spark.sql.streaming.stateStore.providerClass"] = \
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    spark = spark_stretch.session(conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    tmp = Path(tempfile.mkdtemp(prefix="bench-grouped-"))
    res = {"events": a.events, "users": a.users, "files": a.files}
    try:
        src = write_events(tmp / "src", a.events, a.users, a.files)
        res["native_s"] = run_native(spark, src, tmp / "native", tmp / "native-ckpt")
        q, res["stretch_s"] = run_stretch(spark, src, tmp / "stretch", tmp / "stretch-ckpt")
        m = q.metrics()
        res["stretch_state_keys"] = m["engine"]["state_keys"]
        res["stretch_engine_s"] = sum(b["engine_s"] for b in m["batch_times"])
        nat = spark.read.format("delta").load(str(tmp / "native"))
        got = spark.read.format("delta").load(str(tmp / "stretch"))
        res["rows"] = nat.count()
        res["equal"] = (got.count() == res["rows"] and nat.exceptAll(got).count() == 0
                        and got.exceptAll(nat).count() == 0)
        res["native_events_per_s"] = a.events / res["native_s"]
        res["stretch_events_per_s"] = a.events / res["stretch_s"]
        res["throughput_ratio"] = res["native_s"] / res["stretch_s"]
        print("RESULT " + json.dumps(res), flush=True)  # the main figures, whatever follows

        # Rescale, stretch: restart from the checkpoint (state restored), switch 2 -> 1 -> 2.
        t0 = time.perf_counter()
        q, _ = run_stretch(spark, src, tmp / "stretch", tmp / "stretch-ckpt",
                           processingTime="1 second")
        q.metrics()  # waits until the query is open on its engine (state restored)
        res["stretch_restart_open_s"] = time.perf_counter() - t0
        recs = [q.reconfigure(parallelism=1), q.reconfigure(parallelism=2)]
        q.stop()
        res["stretch_switch_ms"] = [r["switch_ms"] for r in recs]
        res["stretch_reconfigure_request_ms"] = [r["request_ms"] for r in recs]
        res["stretch_moved_buckets"] = [r["moved_buckets"] for r in recs]
        res["stretch_state_keys_at_switch"] = recs[0]["state_keys"]

        # Rescale, Spark's route: (the query is stopped) repartition the state checkpoint, restart.
        mgr = getattr(spark, "_streamingCheckpointManager", None)
        if mgr is None:
            res["spark_repartition"] = "not available in this pyspark"
        else:
            t0 = time.perf_counter()
            try:
                mgr.repartition(str(tmp / "native-ckpt"), 1)
            except Exception as e:  # Spark 4.2 repartitions RocksDB state stores only
                why = [ln for ln in str(e).splitlines() if "STATE_REPARTITION" in ln]
                res["spark_repartition"] = ("failed: " + (why or str(e).splitlines())[0]
                                            .split("Error: ")[-1])[:300]
            else:
                res["spark_repartition_s"] = time.perf_counter() - t0
                res["spark_restart_s"] = run_native(spark, src, tmp / "native",
                                                    tmp / "native-ckpt")
                res["spark_rescale_total_s"] = res["spark_repartition_s"] + res["spark_restart_s"]
                # Against the slower of stretch's two requests (driver round trip included).
                res["rescale_ratio"] = (res["spark_rescale_total_s"] * 1e3
                                        / max(res["stretch_reconfigure_request_ms"]))
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(res))
        return
    print(f"sessionization of {a.events:,} events over {a.users:,} users, {a.files} batches, "
          f"local[2]: {res['rows']:,} output rows, outputs equal: {res['equal']}")
    print(f"  native applyInPandasWithState: {res['native_s']:8.1f} s  "
          f"{res['native_events_per_s']:10,.0f} events/s")
    print(f"  stretch drop-in (2 instances): {res['stretch_s']:8.1f} s  "
          f"{res['stretch_events_per_s']:10,.0f} events/s   ratio {res['throughput_ratio']:.2f}x")
    print(f"  rescale 2->1->2, stretch reconfigure: switch {res['stretch_switch_ms']} ms, "
          f"request {[round(x, 1) for x in res['stretch_reconfigure_request_ms']]} ms, "
          f"{res['stretch_state_keys_at_switch']:,} keys in state, none moved")
    if "spark_repartition_s" in res:
        print(f"  rescale 2->1, Spark: repartition {res['spark_repartition_s']:.1f} s + restart "
              f"{res['spark_restart_s']:.1f} s = {res['spark_rescale_total_s']:.1f} s "
              f"(after stopping the query): {res['rescale_ratio']:,.0f}x stretch's request")
    else:
        print(f"  rescale, Spark: {res['spark_repartition']}")


if __name__ == "__main__":
    main()
