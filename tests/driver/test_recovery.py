"""Recovery: the engine killed at every step of a batch, failing tasks, reconfigurations in flight,
incremental checkpoints. Every test ends with the exact native table (no loss, no duplicates)."""

from __future__ import annotations

import datetime
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F

from spark_stretch.driver import recovery
from spark_stretch.driver.engine import EngineDiedError
from spark_stretch.host.faults import ENV
from spark_stretch.testing import (assert_same_rows, publish, run_native, run_script, run_stretch,
                                   write_tweets)
from spark_stretch.testing.processes import driver_env, kill_driver, kill_driver_once_logged
from spark_stretch.testing import tweet_source as source

FILES = 5


def _agg(spark, src, **kw):
    return source(spark, src).stretchAggregate(
        keys=F.col("words"), window=("60 seconds", "30 seconds"), parallelism=2,
        max_parallelism=2, **kw)


@pytest.fixture(scope="module")
def stream(spark, tmp_path_factory):
    """A 5-batch stream with late rows, and the native table over it (the oracle)."""
    tmp = tmp_path_factory.mktemp("recovery")
    src = write_tweets(tmp / "src", 1500, files=FILES, rate=10.0, vocab=80, late_fraction=0.03,
                       jitter_s=5.0, seed=31)
    want = run_native(spark, _agg(spark, src), tmp / "native")
    assert want.count() > 0
    return src, want


@pytest.fixture(scope="module")
def ontime(spark, tmp_path_factory):
    """As ``stream`` but without late rows, so the table does not depend on when idle flushes
    (Spark's no-data batches) happen between files: the oracle for processing-time runs."""
    tmp = tmp_path_factory.mktemp("recovery-ontime")
    src = write_tweets(tmp / "src", 1500, files=FILES, rate=10.0, vocab=80, jitter_s=5.0,
                       seed=32)
    want = run_native(spark, _agg(spark, src), tmp / "native")
    assert want.count() > 0
    return src, want


def _run(spark, src, tmp_path, **conf):
    """One availableNow run of ``_agg`` into ``tmp_path/o`` with the Spark settings ``conf``."""
    for k, v in conf.items():
        spark.conf.set(k, str(v).lower())
    try:
        q = (_agg(spark, src).writeStream.format("delta")
             .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True)
             .start(str(tmp_path / "o")))
        q.awaitTermination()
    finally:
        for k in conf:
            spark.conf.unset(k)
    return q


def _equal(got, want):
    assert_same_rows(got, want)
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                       ignore_metadata=True)


@pytest.mark.parametrize("point,batch,interval", [
    ("commit", 2, 10), ("step", 2, 10), ("checkpoint", 2, 1)] + [  # (the others: for time, slow)
    pytest.param(*p, marks=pytest.mark.slow) for p in [
        ("files", 2, 10), ("write", 2, 10), ("logged", 2, 10), ("step", 2, 1), ("read", 2, 10),
        ("direct", 2, 10), ("saved", 2, 10), ("step", FILES - 1, 10)]])
def test_engine_killed_at_each_step_of_a_batch_is_restarted(spark, stream, tmp_path, monkeypatch,
                                                            point, batch, interval):
    # kill -9 of the engine process while a batch is ingested (its files read by the engine, or
    # written by the executors and committed), logged, stepped (in the
    # background, after Spark committed it), read back by Spark (directWrite off) or appended to
    # Delta by the engine itself, while its checkpoint is written or waited for; the last batch's
    # step dies after Spark ended the run. The engine restarts from its latest checkpoint, redoes
    # the logged batches after it, and Delta's txn action keeps the table exact. With the default
    # checkpoint interval (10) the only checkpoint of a 5-batch run is the first batch's; with 1
    # every batch is checkpointed.
    src, want = stream
    monkeypatch.setenv(ENV, f"kill@{point}:{batch}:{tmp_path / 'fired'}")
    q = _run(spark, src, tmp_path, **{"spark.stretch.delta.directWrite": str(point != "read"),
                                      # (logged: by the files, the route by default)
                                      "spark.stretch.ingest.files": str(point in ("files",
                                                                                  "logged")),
                                      "spark.stretch.checkpoint.interval": interval})
    assert (tmp_path / "fired").exists(), "the fault did not fire"
    restarts = q.metrics()["engine_restarts"]
    assert len(restarts) == 1, restarts
    # The death is seen by the next request: in the batch itself, or in the next one while
    # this one is in flight (its step and output overlap the next batch's ingest).
    cause = re.search(rf"died \(exit status -{int(signal.SIGKILL)}\) during (.*)",
                      restarts[0]["cause"])
    assert cause and str(batch) in re.findall(r"batch (\d+)", cause.group(1)), restarts
    # Continued from a checkpoint at most two batches back (the previous one may still have
    # been in writing), never from one after the batch; or from the first batch's.
    start = restarts[0]["resumed_from"]
    assert start == 0 if interval > batch else batch - 2 <= start <= batch, restarts
    _equal(spark.read.format("delta").load(str(tmp_path / "o")), want)


def test_engine_killed_with_fail_policy_fails_the_query_then_restart_is_exact(
        spark, stream, tmp_path, monkeypatch):
    src, want = stream
    monkeypatch.setenv(ENV, f"kill@step:3:{tmp_path / 'fired'}")
    spark.conf.set("spark.stretch.onEngineFailure", "fail")
    try:
        q = (_agg(spark, src).writeStream.format("delta")
             .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True)
             .start(str(tmp_path / "o")))
        with pytest.raises(StreamingQueryException, match=r"host engine \(pid \d+\) died"):
            q.awaitTermination(180)
    finally:
        spark.conf.unset("spark.stretch.onEngineFailure")
    assert not q.isActive
    # The user restarts the query from its checkpoint: batches 0-2 are not redone.
    got = run_stretch(spark, _agg(spark, src), tmp_path / "o", checkpoint=tmp_path / "c")
    _equal(got, want)


@pytest.mark.parametrize("key,value", [
    ("spark.stretch.onEngineFailure", "retry-forever"),
    ("spark.stretch.maxEngineRestarts", "-1"),
    ("spark.stretch.checkpoint.interval", "0"),
    ("spark.stretch.checkpoint.fsync", "yes"),
    ("spark.stretch.ingest.files", "maybe"),
    ("spark.stretch.engine.niceness", "30"),
])
def test_a_bad_setting_is_named_before_the_query_starts(spark, stream, tmp_path, key, value):
    spark.conf.set(key, value)
    try:
        with pytest.raises(ValueError, match=re.escape(f"{key}='{value}'")):
            _agg(spark, stream[0]).writeStream.format("delta").option(
                "checkpointLocation", str(tmp_path / "c")).start(str(tmp_path / "o"))
    finally:
        spark.conf.unset(key)
    assert not spark.streams.active


def _wait(cond, what, timeout=180):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _feed(src, dst, k):
    """Publish file ``k`` of ``src`` into the streamed folder ``dst`` (atomically)."""
    publish(sorted(Path(src).glob("*.parquet"))[k], dst)


def test_reconfiguration_in_flight_when_the_engine_dies(spark, ontime, tmp_path, monkeypatch):
    # 1. A reconfiguration succeeds, then the engine dies in the next batch, before that batch's
    #    checkpoint: the restarted engine applies the reconfiguration again.
    # 2. The engine dies half way through a reconfiguration (one operator switched): the caller
    #    gets the error and the next batch restarts the engine from its checkpoint.
    # Faults are armed by removing their marker file (see spark_stretch.host.faults).
    src, want = ontime
    live = tmp_path / "live"
    live.mkdir()
    step, reconf = tmp_path / "step", tmp_path / "reconf"
    step.touch()
    reconf.touch()
    monkeypatch.setenv(ENV, f"kill@step:*:{step},kill@reconfigure:*:{reconf}")
    for k in range(3):
        _feed(src, live, k)
    q = (_agg(spark, live).writeStream.format("delta")
         .option("checkpointLocation", str(tmp_path / "c"))
         .trigger(processingTime="200 milliseconds").start(str(tmp_path / "o")))
    try:
        _wait(lambda: q.metrics()["batches"] >= 3, "3 batches")
        assert q.reconfigure(parallelism=1)["parallelism"] == 1
        step.unlink()
        _feed(src, live, 3)
        _wait(lambda: len(q.metrics().get("engine_restarts", [])) == 1 and step.exists()
              and q.metrics()["engine"]["parallelism"] == 1, "the restart after the step fault")
        reconf.unlink()
        with pytest.raises(EngineDiedError, match="died"):
            q.reconfigure(parallelism=2)
        assert reconf.exists()
        _feed(src, live, 4)
        rows = want.count()
        _wait(lambda: spark.read.format("delta").load(str(tmp_path / "o")).count() >= rows,
              "every window written")
        m = q.metrics()
        assert len(m["engine_restarts"]) == 2 and m["engine"]["parallelism"] == 1
    finally:
        q.stop()
    _equal(spark.read.format("delta").load(str(tmp_path / "o")), want)


def test_a_batch_committed_after_the_restart_read_the_commit_log(spark, ontime, tmp_path,
                                                                monkeypatch):
    # A driver killed a moment ago can leave its JVM running long enough to commit one more
    # batch after the restarted query read the commit log (and opened the engine after the batch
    # before). Spark continues after the batch it committed, so the engine must too (from that
    # batch's checkpoint or logged input), or the batch would be missing from the state.
    # Simulated here: the restart reads the commit log one batch short.
    src, want = ontime
    live = tmp_path / "live"
    live.mkdir()
    for k in range(3):
        _feed(src, live, k)
    run_stretch(spark, _agg(spark, live), tmp_path / "o", checkpoint=tmp_path / "c")
    for k in range(3, FILES):
        _feed(src, live, k)
    real, reads = recovery.last_committed, []

    def one_short(checkpoint):
        reads.append(real(checkpoint))
        return reads[-1] - 1 if len(reads) == 1 else reads[-1]

    monkeypatch.setattr(recovery, "last_committed", one_short)
    q = (_agg(spark, live).writeStream.format("delta")
         .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True)
         .start(str(tmp_path / "o")))
    q.awaitTermination()
    assert reads[0] == 2
    # (the latest checkpoint at or before batch 2: the first batch's, at the default interval)
    assert q.metrics()["realigned"] == {"opened_after": 1, "continued_after": 2, "checkpoint": 0}
    _equal(spark.read.format("delta").load(str(tmp_path / "o")), want)


def test_restart_after_a_last_flush_that_only_moved_the_watermark(spark, tmp_path):
    # An availableNow run whose closing no-data batch emits nothing but moves the watermark (to
    # 90 s here): after a restart, a row whose windows all end by then is late. Native Spark
    # keeps that watermark in the offset log of its no-data batch; the engine must checkpoint
    # the flush even without rows, or it would count the row (and emit its windows).
    staged, live = tmp_path / "staged", tmp_path / "live"
    staged.mkdir()
    live.mkdir()

    def put(name, rows):  # rows: (event time in s, words)
        pq.write_table(pa.table({
            "ts": pa.array([t * 1_000_000 for t, _ in rows], pa.timestamp("us", tz="UTC")),
            "words": pa.array([w for _, w in rows], pa.list_(pa.string())),
            "user": pa.array(["u"] * len(rows)), "len": pa.array([len(w) for _, w in rows])}),
            staged / name)
        publish(staged / name, live)

    def both():
        for out in ("n", "o"):
            agg = _agg(spark, live)
            q = ((agg.native().writeStream.outputMode("append") if out == "n" else
                  agg.writeStream).format("delta").trigger(availableNow=True)
                 .option("checkpointLocation", str(tmp_path / f"{out}-ckpt"))
                 .start(str(tmp_path / out)))
            q.awaitTermination()
        return [spark.read.format("delta").load(str(tmp_path / out)) for out in ("n", "o")]

    put("0.parquet", [(100, ["a"])])  # windows [60, 120) and [90, 150): none closes at 90 s
    both()
    put("1.parquet", [(50, ["b"]), (130, ["c"])])  # "b": windows [0, 60) and [30, 90), late
    native, got = both()
    assert [tuple(r) for r in native.select("window.start", "key", "count").collect()] == [
        (datetime.datetime(1970, 1, 1, 0, 1, tzinfo=None), "a", 1)], native.collect()
    _equal(got, native)


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_incremental_checkpoints_cleaned_like_min_batches_to_retain(spark, tmp_path):
    src = write_tweets(tmp_path / "src", 2400, files=8, rate=10.0, vocab=60, seed=33)
    q = _run(spark, src, tmp_path, **{"spark.sql.streaming.stateStore.minDeltasForSnapshot": 3,
                                      "spark.sql.streaming.minBatchesToRetain": 2,
                                      "spark.stretch.checkpoint.interval": 1})
    saves = [b["checkpoint"] for b in q.metrics()["batch_times"]]
    # 4096 buckets, 60 words: a batch changes a few hundred buckets, so deltas pay; a full
    # checkpoint every 3 batches (minDeltasForSnapshot).
    assert [s["kind"] for s in saves] == ["full", "delta", "delta"] * 2 + ["full", "delta"]
    for s in saves:
        assert s["bytes"] > 0 and s["write_ms"] >= 0
        if s["kind"] == "delta":
            assert 0 < s["buckets"] < 4096 / 4
    # The last 2 batches (6, 7) are kept. Batch 7's is still its delta: the run's final flush is
    # in the Delta table (its txn action), so it is not checkpointed again; a restart redoes it
    # from batch 7's state, unwritten.
    state = tmp_path / "c" / "stretch" / "state"
    assert sorted(int(d.name) for d in state.iterdir() if d.name.isdigit()) == [6, 7]
    assert json.loads((state / "7" / "bridge.json").read_text())["kind"] == "delta"
    assert q.metrics()["flushes"] == 1
    # A restart continues from base + delta and, fed the same files again, adds nothing.
    rows = spark.read.format("delta").load(str(tmp_path / "o")).count()
    again = run_stretch(spark, _agg(spark, src), tmp_path / "o", checkpoint=tmp_path / "c")
    assert again.count() == rows
    _equal(again, run_native(spark, _agg(spark, src), tmp_path / "n"))


@pytest.mark.slow  # a kill and restart: in `make test-slow`
def test_engine_state_checkpointed_every_interval_with_the_input_log_between(spark, tmp_path):
    # spark.stretch.checkpoint.interval=3: the state after batches 0, 3 and 6 is checkpointed;
    # the batches between are kept in the input log until the next checkpoint covers them, and
    # a restart steps them again on the latest checkpoint.
    src = write_tweets(tmp_path / "src", 2400, files=8, rate=10.0, vocab=60, seed=34)
    q = _run(spark, src, tmp_path, **{"spark.stretch.checkpoint.interval": 3})
    kinds = [b["checkpoint"]["kind"] for b in q.metrics()["batch_times"]]
    assert [k != "log" for k in kinds] == [True, False, False] * 2 + [True, False], kinds
    ckpt = tmp_path / "c" / "stretch"
    assert sorted(int(d.name) for d in (ckpt / "state").iterdir() if d.name.isdigit()) == [0, 3, 6]
    # (batch 7 read from its files by the engine: logged by reference)
    assert sorted(f.name for f in (ckpt / "input").iterdir()) == ["7.files"]
    want = run_native(spark, _agg(spark, src), tmp_path / "n")
    _equal(spark.read.format("delta").load(str(tmp_path / "o")), want)
    # Restarted with one more file: state 6, batch 7 again from the log, then batch 8.
    more = write_tweets(tmp_path / "more", 300, files=1, first_file=8, rate=10.0, vocab=60,
                        seed=34)
    publish(next(more.glob("*.parquet")), src)
    q = _run(spark, src, tmp_path)
    assert q.metrics()["engine"]["batches"] == 9
    _equal(spark.read.format("delta").load(str(tmp_path / "o")),
           run_native(spark, _agg(spark, src), tmp_path / "n2"))


@pytest.mark.slow  # (the default run stays under 20 minutes; make test-slow)
def test_task_failures_in_ingest_and_output_read_are_retried_by_spark():
    # local[2,3]: Spark retries a failed task (local[2] would not). In its own process.
    result = run_script(Path(__file__).with_name("fault_job.py"))
    # Both faults failed their task (a failed write or read task fails its job unless Spark
    # retries it), the engine never restarted, and the table equals native (checked in the job).
    assert result["fired"] == ["read", "write"]
    assert result["engine_restarts"] == 0


def _native_on_the_batches_spark_ran(spark, ckpt: Path, tmp: Path):
    """The native table over the micro-batches a killed-and-restarted run really had.

    Spark's file source logs the files of a batch (``sources/0/<k>``) before the batch is in the
    offset log; a driver killed between the two leaves files that the restarted query plans
    into its next batch together with new ones (two files in one batch here, where the first
    run had one a batch). With late rows the table depends on the batches (the watermark moves
    per batch), so the oracle is native Spark fed the same batches: one file per batch,
    rebuilt from the checkpoint's offset and source logs.
    """
    ends = {int(f.name): json.loads(f.read_text().splitlines()[-1])["logOffset"]
            for f in (ckpt / "offsets").iterdir() if f.name.isdigit()}
    files = {}
    for f in (ckpt / "sources" / "0").iterdir():
        if f.name.split(".")[0].isdigit():  # (N, or N.compact)
            for line in f.read_text().splitlines()[1:]:
                entry = json.loads(line)
                files[entry["batchId"]] = entry["path"]
    staged, live = tmp / "staged", tmp / "batches"
    staged.mkdir()
    live.mkdir()
    prev = -1
    for n in sorted(ends):
        if ends[n] == prev:  # a no-data batch (it moves no watermark: nothing to feed)
            continue
        parts = [pq.read_table(urlparse(files[k]).path) for k in range(prev + 1, ends[n] + 1)]
        pq.write_table(pa.concat_tables(parts), staged / f"batch-{n:06d}.parquet")
        publish(staged / f"batch-{n:06d}.parquet", live)  # (in order: increasing mtimes)
        prev = ends[n]
    return run_native(spark, _agg(spark, live), tmp / "native")


@pytest.mark.slow  # a kill and restart: in `make test-slow`
def test_driver_killed_mid_batch_then_restart_is_exact(spark, stream, tmp_path):
    # The query runs in a driver process that is killed (-9) in the middle of the run; its engine
    # dies with it (no orphan), and a restart from the checkpoint gives the exact table.
    src, _ = stream
    env = driver_env(tmp_path, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env[ENV] = f"fail@step:3:{tmp_path / 'never'}"  # not a fault: a marker that batch 3 began
    (tmp_path / "never").touch()  # exists, so the "fault" never fires
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("driver_job.py")),
                             str(src), str(tmp_path / "o"), str(tmp_path / "c")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # batch 2 logged (by its files); Spark may or may not have committed it
    kill_driver_once_logged(proc, tmp_path / "c" / "stretch" / "input" / "2.files")
    committed = sorted(int(f.name) for f in (tmp_path / "c" / "commits").iterdir()
                       if f.name.isdigit())
    assert committed and committed[-1] < FILES - 1, "the run ended before the kill"
    got = run_stretch(spark, _agg(spark, src), tmp_path / "o", checkpoint=tmp_path / "c")
    _equal(got, _native_on_the_batches_spark_ran(spark, tmp_path / "c", tmp_path))


def _spelled(spark, src, spelling):
    """``_agg``, or ``stretch(df)`` of the native word count it is (driver_job.py's two)."""
    if spelling != "stretch":
        return _agg(spark, src)
    import spark_stretch
    return spark_stretch.stretch(
        source(spark, src).select(F.explode("words").alias("word"), "ts")
        .groupBy(F.window("ts", "60 seconds", "30 seconds"), "word").count(),
        parallelism=2, max_parallelism=2)


@pytest.mark.slow  # (kept out of the default run for time; CI runs it with -m slow)
@pytest.mark.parametrize("spelling", [  # (stretch(df) recovers through the same Recovery)
    "stretchAggregate", "stretch"])
def test_driver_killed_after_spark_committed_a_batch_the_engine_had_not_stepped(
        spark, stream, tmp_path, spelling):
    # Pipelined batches: Spark commits batch 2 once its input is in the engine's input log,
    # while the engine still steps it (stalled here). The driver dies then; the restart loads
    # the checkpoint of batch 1, steps batch 2 again from the log, and the table is exact.
    # The same for stretch(df) written straight to Delta (the engine appends, pipelined).
    src, _ = stream
    env = driver_env(tmp_path, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env[ENV] = f"stall@step:2:{tmp_path / 'stalled'}"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("driver_job.py")),
                             str(src), str(tmp_path / "o"), str(tmp_path / "c"), spelling],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ckpt = tmp_path / "c"
    deadline = time.time() + 300
    while not ((ckpt / "commits" / "2").exists() and (tmp_path / "stalled").exists()):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "batch 2 was never committed"
        time.sleep(0.05)
    assert (ckpt / "stretch" / "input" / "2.files").exists()  # (read from its files)
    assert not (ckpt / "stretch" / "state" / "2").exists()
    kill_driver(proc)
    # Its engine exits within seconds (it does not wait for the stalled step).
    _wait(lambda: subprocess.run(["pgrep", "-f", "spark_stretch.host.daemon"],
                                 capture_output=True).returncode != 0, "the engine's exit", 30)
    assert not (ckpt / "stretch" / "state" / "2").exists()
    got = run_stretch(spark, _spelled(spark, src, spelling), tmp_path / "o", checkpoint=ckpt)
    want = _native_on_the_batches_spark_ran(spark, ckpt, tmp_path)
    _equal(got.toDF(*want.columns), want)
    # The log holds the batches after the latest checkpoint, no others.
    states = [int(d.name) for d in (ckpt / "stretch" / "state").iterdir() if d.name.isdigit()]
    logged = sorted(int(f.stem) for f in (ckpt / "stretch" / "input").iterdir())
    last = max(int(f.name) for f in (ckpt / "commits").iterdir() if f.name.isdigit())
    assert logged == list(range(max(states) + 1, last + 1)), (states, logged)
