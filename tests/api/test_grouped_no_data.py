"""The drop-in's no-data batches, against the native ``applyInPandasWithState`` on the same input.

Native Spark runs a micro-batch without data when the last one asks for it (the watermark moved
under ``EventTimeTimeout``; every trigger under ``ProcessingTimeTimeout``); the drop-in's
``foreachBatch`` query gets none, so the driver plays one whenever Spark's trigger finds no data.
Each test feeds both queries the same files, one per step, and compares the rows each has
written at the same points.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd
from deltalake import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupStateTimeout

# Shipped by value: Python workers and stretch instances cannot import this test module.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _drop(folder: Path, name: str, lines) -> None:
    """Publish one file of ``lines`` into a streamed folder atomically (hidden, then renamed)."""
    tmp = folder / f".{name}"
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.rename(tmp, folder / name)


def _native(df, checkpoint: Path, **trigger):
    """The native query in update mode; its rows so far (a list the batches append to)."""
    rows = []

    def collect(batch, batch_id):
        rows.extend(tuple(r) for r in batch.collect())

    w = df.writeStream.outputMode("update").foreachBatch(collect) \
        .option("checkpointLocation", str(checkpoint))
    q = (w.trigger(**trigger) if trigger else w).start()
    return q, lambda: sorted(rows)


def _stretch(g, out: Path, checkpoint: Path, **trigger):
    """The drop-in into Delta; its rows so far, read with deltalake (no Spark job)."""
    w = g.writeStream.outputMode("update").format("delta") \
        .option("checkpointLocation", str(checkpoint))
    q = (w.trigger(**trigger) if trigger else w).start(str(out))

    def rows():
        if not (out / "_delta_log").is_dir():
            return []
        t = DeltaTable(str(out)).to_pyarrow_table()
        return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)))
    return q, rows


def keep_max(key, pdfs, state):
    """The largest event time (s) of the key; times out 5 s of event time after it (-1)."""
    if state.hasTimedOut:
        state.remove()
        yield pd.DataFrame({"k": [key[0]], "v": [-1]})
        return
    top = state.get[0] if state.exists else None
    for pdf in pdfs:
        for ts in pdf["ts"]:
            s = int(pd.Timestamp(ts).timestamp())
            top = s if top is None else max(top, s)
    state.update((top,))
    state.setTimeoutTimestamp(top * 1000 + 5000)
    yield pd.DataFrame({"k": [key[0]], "v": [top]})


def test_event_time_step_applies_before_the_next_rows_as_native(spark, tmp_path):
    # Native runs a no-data batch before processAllAvailable returns: ("a", 15) moves the
    # watermark to 5 s, so ("a", 4) is late and dropped; ("b", 31) moves it to 21 s, which times
    # "a" out (its timeout is 20 s) before processAllAvailable returns.
    args = (keep_max, "k string, v long", "m long", "Update", GroupStateTimeout.EventTimeTimeout)

    def frame(src):
        df = spark.readStream.schema("k string, t int").json(str(src))
        return df.select("k", F.timestamp_seconds("t").alias("ts")) \
            .withWatermark("ts", "10 seconds").groupBy("k")

    (tmp_path / "ns").mkdir()
    (tmp_path / "ss").mkdir()
    nq, native = _native(frame(tmp_path / "ns").applyInPandasWithState(*args), tmp_path / "nc")
    sq, stretch = _stretch(frame(tmp_path / "ss").stretchAggregate(*args), tmp_path / "o",
                           tmp_path / "sc")
    seen = []
    try:
        for i, (k, t) in enumerate([("a", 15), ("a", 4), ("b", 31)]):
            for src, q in ((tmp_path / "ns", nq), (tmp_path / "ss", sq)):
                _drop(src, f"{i}.json", [json.dumps({"k": k, "t": t})])
                q.processAllAvailable()
            seen.append((native(), stretch()))
    finally:
        nq.stop()
        sq.stop()
    assert seen[-1][0] == [("a", -1), ("a", 15), ("b", 31)]
    assert [s for _, s in seen] == [n for n, _ in seen]
    m = sq.metrics()
    assert m["engine"]["late_rows"] == 1 and m["engine"]["timeout_calls"] == 1
