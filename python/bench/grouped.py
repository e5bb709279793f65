"""applyInPandasWithState vs its stretch drop-in: sessionization, side by side in one run.

    python python/bench/grouped.py [--events 1000000] [--users 100000] [--files 10] [--json]
                                   [--rocksdb] [--no-recovery] [--master local[2]]

The same parquet stream (``--files`` files = micro-batches, availableNow, local[2]) of events
``(ts, user, value)`` goes through (1) native ``groupBy("user").applyInPandasWithState(sessions,
..., "Update", EventTimeTimeout)`` written to Delta by ``foreachBatch`` (Delta has no update-mode
sink) and (2) ``groupBy("user").stretchApplyInPandasWithState(<same arguments>)`` into Delta.
Outputs are checked equal (exceptAll both ways). Reported: events per second and the ratio.

Rescale: (a) stretch: the query restarted from its checkpoint (all state restored), then
``reconfigure(parallelism=1)`` and back to 2 while it runs: switch time (owner map swap; no
restart, no state moved); (b) Spark's route: the native query is stopped (it ended), its state
checkpoint repartitioned to 1 partition with ``spark._streamingCheckpointManager.repartition``
(new in Spark 4.2), and restarted: repartition time and restart time. Spark 4.2 repartitions
RocksDB state stores only (``STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_PROVIDER`` for the
default HDFS-backed one); run with ``--rocksdb`` to give the native query RocksDB, or the failure
is reported.

Recovery (``--no-recovery`` skips it): each query runs the stream again from scratch twice,
first as is (its baseline, the session warm), then with a function that kills the process
running it (SIGKILL) once, at its first call with an event of the middle file (a marker file
makes it once per run): a Python worker of native Spark, an instance process of the drop-in.
Native Spark on ``local[2]`` runs a task once, so the worker's death fails the query, which is
restarted from its checkpoint (as Spark's own random-failure test of ``applyInPandasWithState``
does: a loop restarting the query); ``--master 'local[2,4]'`` gives it task retries instead.
The drop-in starts that instance again and runs only its share of the batch again. Reported:
the time from the kill (written by the dying function) to the killed batch done again (native:
the first batch of its last run to end after the kill, from its progress: after a query
restart, the restarted query's first batch; the drop-in: that batch's output written) and each
side's run with the kill minus its baseline, with the ratios; the drop-in's instance restart
times, native's query restarts; both tables checked equal to native's run without a kill.

Fair set-up for native Spark: the same session (local[2], spark.driver.memory=4g),
spark.sql.shuffle.partitions=2 (one per core), the default HDFS-backed state store; stretch runs 2
instance processes (parallelism=2), the same parallelism.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming.state import GroupStateTimeout

import spark_stretch
from workdir import bench_run

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


def dies_once(marker: str, after_ms: int):
    """``sessions``, but the process running it kills itself once (the first to create
    ``marker``, into which it writes the time), at its first call with an event at or after
    ``after_ms``."""
    def func(key, pdfs, state):
        pdfs = list(pdfs)
        if not state.hasTimedOut and not os.path.exists(marker) and any(
                int((p["ts"].astype("int64") // 1_000_000).max()) >= after_ms for p in pdfs):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, repr(time.time()).encode())  # when it died
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        yield from sessions(key, iter(pdfs), state)
    return func


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


def equal_tables(want, got, rows: int) -> bool:
    """Whether ``got`` has ``want``'s ``rows`` rows, the same (exceptAll both ways)."""
    return (got.count() == rows and want.exceptAll(got).count() == 0
            and got.exceptAll(want).count() == 0)


def source(spark, src):
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
            .withWatermark("ts", "10 seconds"))


ARGS = (sessions, OUT, STATE, "Update", GroupStateTimeout.EventTimeTimeout)


def run_native(spark, src, out: Path, ckpt: Path, func=sessions, restarts: list = None
               ) -> float:
    """The native query until it ends; a failed run is restarted from its checkpoint (each
    failure's time appended to ``restarts``, if given, then the end times, ``time.time()``, of
    the last run's batches; else it is raised)."""
    def write(batch, batch_id):
        batch.write.format("delta").mode("append").option("txnAppId", "native") \
            .option("txnVersion", batch_id).save(str(out))

    t0 = time.perf_counter()
    while True:
        q = (source(spark, src).groupBy("user").applyInPandasWithState(func, *ARGS[1:])
             .writeStream.outputMode("update").foreachBatch(write)
             .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
        try:
            q.awaitTermination()
        except StreamingQueryException:
            if restarts is None or len(restarts) >= 5:
                raise
            restarts.append(time.perf_counter() - t0)
            continue
        if restarts is not None:
            restarts.append([datetime.fromisoformat(p["timestamp"]).timestamp()
                             + p["durationMs"]["triggerExecution"] / 1e3
                             for p in q.recentProgress])
        return time.perf_counter() - t0


def run_stretch(spark, src, out: Path, ckpt: Path, func=sessions, **trigger):
    t0 = time.perf_counter()
    q = (source(spark, src).groupBy("user")
         .stretchApplyInPandasWithState(func, *ARGS[1:], parallelism=2, max_parallelism=2)
         .writeStream.outputMode("update").format("delta")
         .option("checkpointLocation", str(ckpt))
         .trigger(**(trigger or {"availableNow": True})).start(str(out)))
    if trigger:
        return q, t0
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(q.exception())
    return q, time.perf_counter() - t0


def recovery(spark, src: Path, tmp: Path, a, res: dict, want) -> dict:
    """Both queries again on the same input, the process running the function killed once in
    the middle file's batch; each side's time to recover against its run without the kill."""
    per = -(-a.events // a.files)
    after_ms = int(((a.files // 2) * per / 1000.0 + 2.0) * 1000)  # past the previous file's
    restarts: list = []
    # Each side's baseline is a run without the kill right before it (the first runs above
    # include the session's warm-up).
    native_base = run_native(spark, src, tmp / "native-b", tmp / "native-b-ckpt")
    native_s = run_native(spark, src, tmp / "native-k", tmp / "native-k-ckpt",
                          dies_once(str(tmp / "native-died"), after_ms), restarts)
    _, stretch_base = run_stretch(spark, src, tmp / "stretch-b", tmp / "stretch-b-ckpt")
    q, stretch_s = run_stretch(spark, src, tmp / "stretch-k", tmp / "stretch-k-ckpt",
                               dies_once(str(tmp / "stretch-died"), after_ms))
    m = q.metrics()
    retried = [r for b in m["batch_times"] for r in b.get("retries", [])]
    killed = [b["batch"] for b in m["batch_times"] if b.get("retries")]
    def died_at(who):
        f = tmp / f"{who}-died"
        return float(f.read_text()) if f.exists() else None

    # From the kill to the killed batch done again: native, the first batch of its last run to
    # end after the kill (after a query restart, that run's first); the drop-in, that batch's
    # output written.
    ends = restarts.pop()
    native_end = min((e for e in ends if died_at("native") and e >= died_at("native")),
                     default=None)
    stretch_end = next((b["time_ms"] / 1e3 for b in m["per_batch"] if killed
                        and b["batch"] == killed[0]), None)

    def same(path):
        got = spark.read.format("delta").load(str(path))
        return equal_tables(want, got, res["rows"])

    out = {"recovery_killed": [(tmp / f"{w}-died").exists() for w in ("native", "stretch")],
           "recovery_native_kill_to_batch_done_s":
               native_end - died_at("native") if native_end and died_at("native") else None,
           "recovery_stretch_kill_to_batch_done_s":
               stretch_end - died_at("stretch") if stretch_end and died_at("stretch") else None,
           "recovery_native_run_s": native_s, "recovery_native_query_restarts": len(restarts),
           "recovery_native_failed_after_s": restarts,
           "recovery_stretch_run_s": stretch_s,
           "recovery_stretch_instance_retries": m.get("instance_retries", 0),
           "recovery_stretch_engine_restarts": len(m.get("engine_restarts", [])),
           "recovery_stretch_instance_restart_ms": [r["restart_ms"] for r in retried],
           "recovery_stretch_share_recovered_ms": [r.get("recovered_ms") for r in retried],
           "recovery_native_base_s": native_base, "recovery_stretch_base_s": stretch_base,
           "recovery_native_s": native_s - native_base,
           "recovery_stretch_s": stretch_s - stretch_base,
           "recovery_equal": same(tmp / "native-k") and same(tmp / "stretch-k")}
    if out["recovery_stretch_s"] > 0:
        out["recovery_ratio"] = out["recovery_native_s"] / out["recovery_stretch_s"]
    if out["recovery_native_kill_to_batch_done_s"] and out["recovery_stretch_kill_to_batch_done_s"]:
        out["recovery_kill_to_batch_done_ratio"] = (out["recovery_native_kill_to_batch_done_s"]
                                                    / out["recovery_stretch_kill_to_batch_done_s"])
    return out


def write_growth(folder: Path, users_per_file: int, files: int, seed: int = 0) -> Path:
    """``files`` files of one event for each of ``users_per_file`` users never seen before, so
    the live keys grow by as many per batch; event time stays within the first ``files``
    seconds (no session closes during the run: every batch is the same work)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in range(files):
        k = users_per_file
        users = pa.array(np.char.add("u", (f * k + rng.permutation(k)).astype("U10")))
        pq.write_table(pa.table({
            "ts": pa.array(((f + rng.uniform(0, 1.0, k)) * 1e6).astype(np.int64))
                  .cast(pa.timestamp("us", tz="UTC")),
            "user": users, "value": pa.array(rng.integers(0, 100, k), pa.int64())}),
            folder / f"events-{f:05d}.parquet")
    return folder


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _batch_ms(q) -> list:
    return [p["durationMs"]["triggerExecution"] for p in q.recentProgress
            if p["numInputRows"] > 0]


def growth(spark, tmp: Path, a) -> dict:
    """The live keys growing ``--files``-fold over the run (``--growth`` new users per batch,
    one event each): per-batch time at the first and the last batches, state per key, and
    checkpoint bytes, native (RocksDB) and the drop-in side by side."""
    src = write_growth(tmp / "src", a.growth, a.files)
    res = {"growth_users_per_batch": a.growth, "batches": a.files,
           "live_keys_end": a.growth * a.files}

    def write(batch, batch_id):
        batch.write.format("delta").mode("append").option("txnAppId", "native") \
            .option("txnVersion", batch_id).save(str(tmp / "native"))

    if a.native:
        t0 = time.perf_counter()
        q = (source(spark, src).groupBy("user").applyInPandasWithState(*ARGS)
             .writeStream.outputMode("update").foreachBatch(write)
             .option("checkpointLocation", str(tmp / "native-ckpt"))
             .trigger(availableNow=True).start())
        q.awaitTermination()
        res["native_s"] = time.perf_counter() - t0
        res["native_batch_ms"] = _batch_ms(q)
        last = q.recentProgress[-1]["stateOperators"][0]
        res["native_state_rows"] = last["numRowsTotal"]
        res["native_state_memory_bytes"] = last["memoryUsedBytes"]
        res["native_checkpoint_state_bytes"] = _dir_size(tmp / "native-ckpt" / "state")

    t0 = time.perf_counter()
    q = (source(spark, src).groupBy("user")
         .stretchApplyInPandasWithState(*ARGS, parallelism=2, max_parallelism=2)
         .writeStream.outputMode("update").format("delta")
         .option("checkpointLocation", str(tmp / "stretch-ckpt"))
         .trigger(availableNow=True).start(str(tmp / "stretch")))
    hwm, seen = {}, -1
    while q.isActive:  # the engine's processes' peak resident memory (VmHWM) while they live
        p = q.lastProgress
        if p and p["batchId"] > seen:  # a long run shows its batches as they end
            seen = p["batchId"]
            print(f"batch {seen}: {p['numInputRows']} rows, "
                  f"{p['durationMs']['triggerExecution']} ms", file=sys.stderr, flush=True)
        try:
            m = q.metrics()
            for pid in m["engine"].get("instance_pids", []) + [m["engine"].get("pid")]:
                if pid:
                    with open(f"/proc/{pid}/status") as f:
                        for ln in f:
                            if ln.startswith("VmHWM"):
                                hwm[pid] = int(ln.split()[1]) * 1024
        except Exception:
            pass
        time.sleep(1.0)
    q.awaitTermination()
    res["stretch_s"] = time.perf_counter() - t0
    res["stretch_batch_ms"] = _batch_ms(q)
    m = q.metrics()
    res["stretch_state_rows"] = m["engine"]["state_keys"]
    res["stretch_state_disk_bytes"] = m["engine"].get("state_disk_bytes")
    res["stretch_peak_rss_bytes"] = sum(hwm.values())
    res["stretch_checkpoint_state_bytes"] = _dir_size(tmp / "stretch-ckpt" / "stretch" / "state")
    got = spark.read.format("delta").load(str(tmp / "stretch"))
    if a.native:
        nat = spark.read.format("delta").load(str(tmp / "native"))
        res["throughput_ratio"] = res["native_s"] / res["stretch_s"]
    else:  # the oracle: each new user's one event is one open session (no timeout fires);
        # an event at or before the watermark (0 here: event time at the epoch itself) is
        # late and dropped, as Spark drops it with an event-time timeout
        nat = spark.read.parquet(str(src)).where("unix_micros(ts) > 0").selectExpr(
            "user", "unix_micros(ts) div 1000 AS start", "unix_micros(ts) div 1000 AS end",
            "1L AS n", "value AS total", "false AS closed")
    res["rows"] = nat.count()
    res["equal"] = equal_tables(nat, got, res["rows"])
    for side in ("native", "stretch") if a.native else ("stretch",):
        b = res[f"{side}_batch_ms"]
        if len(b) >= 4:  # the second batch (live keys: one batch's) against the last
            res[f"{side}_last_over_second_batch"] = b[-1] / b[1]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rocksdb", action="store_true",
                    help="native state in RocksDB (needed by Spark's repartition)")
    ap.add_argument("--no-recovery", dest="recovery", action="store_false",
                    help="skip the recovery measurement (a killed worker / instance)")
    ap.add_argument("--growth", type=int, default=0, metavar="USERS",
                    help="instead: USERS new users per batch for --files batches (state grows)")
    ap.add_argument("--no-native", dest="native", action="store_false",
                    help="with --growth: the drop-in only, its table checked against a batch "
                         "query over the same files (for sizes native Spark takes hours on)")
    ap.add_argument("--master", default="local[2]",
                    help="Spark master (local[2,4]: native Spark retries a failed task)")
    a = ap.parse_args()
    conf = {"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g"}
    if a.rocksdb:
        conf["spark.sql.streaming.stateStore.providerClass"] = \
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    spark = spark_stretch.session(master=a.master, conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    with bench_run("bench-grouped-") as bench:
        tmp = bench.path
        bench.session(spark)
        res = {"events": a.events, "users": a.users, "files": a.files, "master": a.master}
        if a.growth:
            res = growth(spark, tmp, a)
            print(json.dumps(res), flush=True)
            return
        src = write_events(tmp / "src", a.events, a.users, a.files)
        res["native_s"] = run_native(spark, src, tmp / "native", tmp / "native-ckpt")
        q, res["stretch_s"] = run_stretch(spark, src, tmp / "stretch", tmp / "stretch-ckpt")
        m = q.metrics()
        res["stretch_state_keys"] = m["engine"]["state_keys"]
        res["stretch_engine_s"] = sum(b["engine_s"] for b in m["batch_times"])
        nat = spark.read.format("delta").load(str(tmp / "native"))
        got = spark.read.format("delta").load(str(tmp / "stretch"))
        res["rows"] = nat.count()
        res["equal"] = equal_tables(nat, got, res["rows"])
        res["native_events_per_s"] = a.events / res["native_s"]
        res["stretch_events_per_s"] = a.events / res["stretch_s"]
        res["throughput_ratio"] = res["native_s"] / res["stretch_s"]
        print("RESULT " + json.dumps(res), flush=True)  # the main figures, whatever follows
        if a.recovery:
            res.update(recovery(spark, src, tmp, a, res, nat))
            print("RECOVERY " + json.dumps({k: v for k, v in res.items()
                                            if k.startswith("recovery")}), flush=True)

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
    if a.json:
        print(json.dumps(res))
        return
    print(f"sessionization of {a.events:,} events over {a.users:,} users, {a.files} batches, "
          f"{a.master}: {res['rows']:,} output rows, outputs equal: {res['equal']}")
    print(f"  native applyInPandasWithState: {res['native_s']:8.1f} s  "
          f"{res['native_events_per_s']:10,.0f} events/s")
    print(f"  stretch drop-in (2 instances): {res['stretch_s']:8.1f} s  "
          f"{res['stretch_events_per_s']:10,.0f} events/s   ratio {res['throughput_ratio']:.2f}x")
    print(f"  rescale 2->1->2, stretch reconfigure: switch {res['stretch_switch_ms']} ms, "
          f"request {[round(x, 1) for x in res['stretch_reconfigure_request_ms']]} ms, "
          f"{res['stretch_state_keys_at_switch']:,} keys in state, none moved")
    if "recovery_native_s" in res:
        n, st = (res[f"recovery_{w}_kill_to_batch_done_s"] for w in ("native", "stretch"))
        if n and st:
            how = "query restart" if res["recovery_native_query_restarts"] else "task retry"
            print(f"  recovery, from the kill to the killed batch done again: native {n:.1f} s "
                  f"({how}), stretch {st:.1f} s (instance retry): "
                  f"{res['recovery_kill_to_batch_done_ratio']:.1f}x")
        ratio = res.get("recovery_ratio")
        print(f"  whole runs, with the kill - without (noisy: native's runs drift as the "
              f"session warms up) "
              f"({res['recovery_native_base_s']:.1f} s / {res['recovery_stretch_base_s']:.1f} s "
              f"without): native "
              f"{res['recovery_native_s']:.1f} s ({res['recovery_native_query_restarts']} query "
              f"restart(s)), stretch {res['recovery_stretch_s']:.1f} s "
              f"({res['recovery_stretch_instance_retries']} instance retry; death to the "
              f"share's reply {[round(x or 0) for x in res['recovery_stretch_share_recovered_ms']]}"
              f" ms, "
              f"{res['recovery_stretch_engine_restarts']} engine restarts)"
              + (f": {ratio:.1f}x" if ratio else "")
              + f"; outputs equal: {res['recovery_equal']}")
    if "spark_repartition_s" in res:
        print(f"  rescale 2->1, Spark: repartition {res['spark_repartition_s']:.1f} s + restart "
              f"{res['spark_restart_s']:.1f} s = {res['spark_rescale_total_s']:.1f} s "
              f"(after stopping the query): {res['rescale_ratio']:,.0f}x stretch's request")
    else:
        print(f"  rescale, Spark: {res['spark_repartition']}")


if __name__ == "__main__":
    main()
