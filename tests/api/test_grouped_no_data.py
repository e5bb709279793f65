"""The drop-in's no-data batches, against the native ``applyInPandasWithState`` on the same input.

Native Spark runs a micro-batch without data when the last one asks for it (the watermark moved
under ``EventTimeTimeout``; every trigger under ``ProcessingTimeTimeout``). The drop-in sits in
Spark's plan over Spark's own operator, so Spark decides and runs its no-data batches the same
way. Each test feeds both queries the same files, one per step, and compares the rows each has
written at the same points: after ``processAllAvailable``, or after a processing-time timeout
fired while the stream was idle.
"""

from __future__ import annotations

import pytest

import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
from deltalake import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupStateTimeout

from spark_stretch.host.faults import ENV

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


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


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
    # (through stretchAggregate, the drop-in's first name: an alias of
    # stretchApplyInPandasWithState that existing code keeps calling)
    sq, stretch = _stretch(frame(tmp_path / "ss").stretchAggregate(*args), tmp_path / "o",
                           tmp_path / "sc")
    seen = []
    try:
        for i, (k, t) in enumerate([("a", 15), ("a", 4), ("b", 31)]):
            step = []  # each query's rows as soon as its processAllAvailable returned
            for src, q, rows in ((tmp_path / "ns", nq, native), (tmp_path / "ss", sq, stretch)):
                _drop(src, f"{i}.json", [json.dumps({"k": k, "t": t})])
                q.processAllAvailable()
                step.append(rows())
            seen.append(tuple(step))
    finally:
        nq.stop()
        sq.stop()
    assert seen[-1][0] == [("a", -1), ("a", 15), ("b", 31)]
    assert [s for _, s in seen] == [n for n, _ in seen]
    m = sq.metrics()
    assert m["engine"]["late_rows"] == 1 and m["engine"]["timeout_calls"] == 1


def counting_with_timeout(others_ms: int):
    """A row count per key, timing out ``others_ms`` of processing time after the key's last
    rows (-1); 6 s for "b"."""
    def count(key, pdfs, state):
        if state.hasTimedOut:
            state.remove()
            yield pd.DataFrame({"k": [key[0]], "v": [-1]})
            return
        n = (state.get[0] if state.exists else 0) + sum(len(p) for p in pdfs)
        state.update((n,))
        state.setTimeoutDuration(6000 if key[0] == "b" else others_ms)
        yield pd.DataFrame({"k": [key[0]], "v": [n]})
    return count


timeout_after_3s = counting_with_timeout(3000)
timeout_by_key = counting_with_timeout(1)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_processing_time_timeout_fires_while_idle_as_native(spark, tmp_path):
    # Native runs a no-data batch on every trigger with ProcessingTimeTimeout, so "a" times out
    # about 3 s after its batch and "b" 3 s later, although nothing else arrives. Both queries
    # run side by side.
    args = (timeout_after_3s, "k string, v long", "n long", "Update",
            GroupStateTimeout.ProcessingTimeTimeout)

    def frame(src):
        return spark.readStream.text(str(src)).withColumnRenamed("value", "k").groupBy("k")

    (tmp_path / "ns").mkdir()
    (tmp_path / "ss").mkdir()
    nq, native = _native(frame(tmp_path / "ns").applyInPandasWithState(*args), tmp_path / "nc",
                         processingTime="1 second")
    sq, stretch = _stretch(frame(tmp_path / "ss").stretchApplyInPandasWithState(*args),
                           tmp_path / "o", tmp_path / "sc", processingTime="1 second")
    try:
        # "w" first, so that "a" is not in the first batch (which may take seconds to start)
        for name, keys in (("0.txt", ["w"]), ("1.txt", ["a", "b"])):
            _drop(tmp_path / "ns", name, keys)
            _drop(tmp_path / "ss", name, keys)
            _until(lambda: (keys[0], 1) in native() and (keys[0], 1) in stretch(),
                   f"the batch of {keys}")
        _until(lambda: ("b", -1) in native() and ("b", -1) in stretch(), "the timeouts")
        time.sleep(2.5)  # two more triggers: neither writes anything more
        got, want = stretch(), native()
    finally:
        nq.stop()
        sq.stop()
    assert want == [("a", -1), ("a", 1), ("b", -1), ("b", 1), ("w", -1), ("w", 1)]
    assert got == want


def _committed(checkpoint: Path) -> list:
    commits = checkpoint / "commits"
    return sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit()) \
        if commits.is_dir() else []


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_a_no_data_batch_with_rows_is_written_once_across_engine_and_query_restarts(
        spark, tmp_path, monkeypatch):
    # Spark's no-data batches are the drop-in's own batches: the one that times "a" out (its
    # rows appended to Delta by the engine) loses its engine before its state is saved; the
    # restarted engine runs it again without writing it again. Then a stop and a restart from
    # the checkpoint: the next timeouts once too.
    args = (timeout_by_key, "k string, v long", "n long", "Update",
            GroupStateTimeout.ProcessingTimeTimeout)  # (1 ms for all but "b")
    src, out, ckpt = tmp_path / "src", tmp_path / "o", tmp_path / "c"
    src.mkdir()
    armed = tmp_path / "kill"
    armed.touch()  # removed to arm the fault (see spark_stretch.host.faults)
    monkeypatch.setenv(ENV, f"kill@saved:*:{armed}")

    def start():
        g = spark.readStream.text(str(src)).withColumnRenamed("value", "k").groupBy("k") \
            .stretchApplyInPandasWithState(*args)
        return _stretch(g, out, ckpt, processingTime="4 seconds")

    q, rows = start()
    try:
        _drop(src, "0.txt", ["a"])  # batch 0 (the first may take seconds to start)
        _until(lambda: _committed(ckpt) == [0], "batch 0 committed")
        armed.unlink()  # the next batch (the no-data batch 1, 4 s later) dies once saved
        _until(lambda: ("a", -1) in rows() and q.metrics().get("engine_restarts"),
               "a's timeout and the engine's restart")
        _until(lambda: 1 in _committed(ckpt), "batch 1 committed")
    finally:
        q.stop()
    assert armed.exists()  # the fault fired
    restarts = q.metrics()["engine_restarts"]
    assert len(restarts) == 1 and "during batch 1" in restarts[0]["cause"], restarts
    assert rows() == [("a", -1), ("a", 1)]
    app = json.loads((ckpt / "stretch" / "query.json").read_text())["app_id"]
    assert DeltaTable(str(out)).transaction_version(app) == 1  # a's timeout: batch 1's rows
    q, rows = start()
    try:
        _drop(src, "1.txt", ["c", "a"])
        _until(lambda: rows().count(("a", -1)) == 2 and ("c", -1) in rows(),
               "the timeouts after the restart")
    finally:
        q.stop()
    assert rows() == [("a", -1), ("a", -1), ("a", 1), ("a", 1), ("c", -1), ("c", 1)]
