"""The stretch operator in Spark's progress: ``lastProgress["stateOperators"]`` and the
``StreamingQueryListener``'s progress events have one entry for it, with the engine's figures.

Oracles: native Spark over the same files (its ``stateOperators``) where the figures mean the
same, an independent count from the input where the engine's state legitimately differs (in
append mode a window becomes a state row when the watermark releases its first row).
"""

from __future__ import annotations

import json
import time

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupStateTimeout

import spark_stretch
from spark_stretch.testing.stepped import event_source, write_steps

from .test_elastic import _Progress
from .test_grouped import (SESSION_OUT, SESSION_STATE, sessions, source, start_stretch,
                           write_tweets)

SIZES, WINDOW_S, DELAY_S = [200, 300, 250, 100], 5, 1


def _listening(spark, run):
    listener = _Progress(lambda p: json.loads(p.json)["stateOperators"])
    spark.streams.addListener(listener)
    try:
        q = run()
        # (the listener bus delivers asynchronously: wait for every progress the query kept)
        deadline = time.time() + 30
        while (sum(qid == str(q.id) for qid, _, _ in listener.events) < len(q.recentProgress)
               and time.time() < deadline):
            time.sleep(0.1)
    finally:
        spark.streams.removeListener(listener)
    return q, listener


def _ops(q):
    """Each progress's state operators, by batch id (``recentProgress``), read from the
    progress's JSON as the listener reads its events (pyspark's progress objects keep an empty
    ``customMetrics`` that Spark's JSON leaves out)."""
    return {p["batchId"]: json.loads(p.json)["stateOperators"] for p in q.recentProgress}


def _seen_by_listener(listener, q, ops):
    mine = {b: so for qid, b, so in listener.events if qid == str(q.id)}
    assert mine and all(mine[b] == ops[b] for b in mine), (mine, ops)


def _live_windows(src, batch):
    """Windows the engine holds after stepping ``batch`` in append mode, applying whole batches
    as Spark does: those of every row so far that W_N (the earlier batches' largest event time -
    the delay) has not closed (end > W_N). One file a batch, in event-time order: no late rows."""
    files = sorted(src.glob("*.parquet"))[:batch + 1]
    tables = [pq.read_table(f) for f in files]
    ts_us = [pc.cast(t["ts"], pa.int64()).to_numpy() for t in tables]
    wm_us = max(0, max((int(t.max()) for t in ts_us[:-1]), default=0) - DELAY_S * 1_000_000)
    rows = pd.concat([pd.DataFrame({"k": t["k"].to_numpy(), "ts": s})
                      for t, s in zip(tables, ts_us)], ignore_index=True)
    start = rows["ts"] // (WINDOW_S * 1_000_000) * (WINDOW_S * 1_000_000)
    open_ = start + WINDOW_S * 1_000_000 > wm_us
    return len(set(zip(rows["k"][open_], start[open_])))


def test_stretch_aggregate_has_one_state_operator_with_the_engines_figures(spark, tmp_path):
    src = write_steps(tmp_path / "src", SIZES, keys=50, seed=3)
    agg = event_source(spark, src, delay=f"{DELAY_S} second").stretchAggregate(
        keys="k", window=f"{WINDOW_S} seconds")

    def run():
        q = (agg.writeStream.format("delta").option("checkpointLocation", str(tmp_path / "c"))
             .trigger(availableNow=True).start(str(tmp_path / "o")))
        q.awaitTermination()
        return q

    q, listener = _listening(spark, run)
    qn = (agg.native().writeStream.format("delta").outputMode("append")
          .option("checkpointLocation", str(tmp_path / "nc")).trigger(availableNow=True)
          .start(str(tmp_path / "no")))
    qn.awaitTermination()
    native = {b: so[0] for b, so in _ops(qn).items()}
    ops = _ops(q)
    assert json.loads(q.lastProgress.json)["stateOperators"] == ops[max(ops)]
    seen, total = set(), {}
    for b, so in ops.items():
        assert len(so) == 1, so
        op = so[0]
        assert op["operatorName"] == "stretchAggregate"
        if "batch" not in op.get("customMetrics", {}):  # (pipelined: none finished yet)
            assert not seen and op["numRowsTotal"] == 0, (b, op)
            continue
        n = op["customMetrics"]["batch"]  # (pipelined: the latest batch the engine finished)
        if n in seen:
            continue
        seen.add(n)
        # closed windows and state rows: native's own counts, and the windows left open
        assert op["numRowsRemoved"] == native[n]["numRowsRemoved"], (n, op, native[n])
        assert op["numRowsTotal"] == native[n]["numRowsTotal"] == _live_windows(src, n), (n, op)
        total[n] = op["numRowsTotal"]
        if n == 0 or n - 1 in total:  # (append mode: the windows the step opened)
            prev = total.get(n - 1, 0)
            assert op["numRowsUpdated"] == op["numRowsTotal"] - prev + op["numRowsRemoved"]
        assert op["numRowsDroppedByWatermark"] == native[n]["numRowsDroppedByWatermark"] == 0
        assert op["memoryUsedBytes"] > 0
        assert op["customMetrics"]["parallelism"] == op["numStateStoreInstances"] == 1
    # (pipelined: a progress shows the batch before when the engine had not finished its own,
    # so which batches show is timing; at least two do)
    assert len(seen) >= 2, ops
    _seen_by_listener(listener, q, ops)


def test_drop_in_state_operator_equals_native(spark, tmp_path):
    src = write_tweets(tmp_path / "src", 480, files=4, rate=12.0, users=60, vocab=30,
                       late_fraction=0.05, late_by_s=20.0, jitter_s=4.0, seed=11)
    args = (sessions, SESSION_OUT, SESSION_STATE, "Update", GroupStateTimeout.EventTimeTimeout)

    def write(batch, batch_id):
        batch.write.format("delta").mode("append").save(str(tmp_path / "n"))

    qn = (source(spark, src).groupBy("user").applyInPandasWithState(*args).writeStream
          .outputMode("update").option("checkpointLocation", str(tmp_path / "nc"))
          .trigger(availableNow=True).foreachBatch(write).start())
    qn.awaitTermination()
    native = {b: so[0] for b, so in _ops(qn).items()}

    def run():
        q = start_stretch(source(spark, src).groupBy("user").stretchApplyInPandasWithState(*args),
                          tmp_path / "o")
        q.awaitTermination()
        return q

    q, listener = _listening(spark, run)
    ops = _ops(q)
    assert json.loads(q.lastProgress.json)["stateOperators"] == ops[max(ops)]
    late = 0
    for b, so in ops.items():
        assert len(so) == 1, so
        op, nat = so[0], native[b]
        # Spark's own operator (planned under the stretch marker, never run), with the
        # engine's figures of the batch (the drop-in is not pipelined)
        assert op["operatorName"] == nat["operatorName"] == "applyInPandasWithState"
        # keys in state, keys written and removed, late rows dropped: native's own counts
        for field in ("numRowsTotal", "numRowsUpdated", "numRowsRemoved",
                      "numRowsDroppedByWatermark"):
            assert op[field] == nat[field], (b, field, op, nat)
        # the store's pages its processes keep mapped; its file on the engine host's disk, as
        # the state store provider names the size of its state (the default, HDFS-backed: of
        # its current version)
        assert op["memoryUsedBytes"] > 0
        assert op["customMetrics"]["stateOnCurrentVersionSizeBytes"] > 0
        late += op["numRowsDroppedByWatermark"]
    assert set(ops) == set(native)  # the same batches, Spark's no-data batch among them
    assert late > 0 and all(any(so[0][f] > 0 for so in ops.values())
                            for f in ("numRowsUpdated", "numRowsRemoved"))
    _seen_by_listener(listener, q, ops)


def test_stretch_df_update_mode_state_operator_equals_native(spark, tmp_path):
    src = write_steps(tmp_path / "src", SIZES, keys=50, seed=5)
    agg = (event_source(spark, src, delay=f"{DELAY_S} second")
           .groupBy(F.window("ts", f"{WINDOW_S} seconds"), "k").agg(F.count("*").alias("n")))

    def start(df, out):
        return (df.writeStream.format("memory").queryName(out).outputMode("update")
                .option("checkpointLocation", str(tmp_path / out)).trigger(availableNow=True)
                .start())

    def run():
        q = start(spark_stretch.stretch(agg), "stretch_ops")
        q.awaitTermination()
        return q

    q, listener = _listening(spark, run)
    qn = start(agg, "native_ops")
    qn.awaitTermination()
    ops, native = _ops(q), _ops(qn)
    assert set(ops) == set(native), (ops, native)
    for b, so in ops.items():
        assert len(so) == 1 and len(native[b]) == 1, so
        op, nat = so[0], native[b][0]
        # Spark's own operator of the chain, with the engine's figures of the batch
        assert op["operatorName"] == nat["operatorName"] == "stateStoreSave"
        for field in ("numRowsTotal", "numRowsUpdated", "numRowsRemoved",
                      "numRowsDroppedByWatermark"):
            assert op[field] == nat[field], (b, field, op, nat)
        assert op["memoryUsedBytes"] > 0
    assert any(so[0]["numRowsTotal"] > 0 for so in ops.values())
    _seen_by_listener(listener, q, ops)
