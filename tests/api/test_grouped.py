"""``groupBy(k).stretchApplyInPandasWithState(func, ...)``: the applyInPandasWithState drop-in.

Oracles: the NATIVE ``applyInPandasWithState`` over the same file stream (availableNow, one file
per micro-batch), both into Delta, compared with chispa; for processing-time timeouts (pyspark has
no manual clock for native queries) a plain-Python sequential run of the same rules.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame
from pyspark.sql.group import GroupedData
from pyspark.sql.streaming.state import GroupStateTimeout

import spark_stretch
import spark_stretch.api
from spark_stretch.host.faults import ENV
from spark_stretch.testing import TWEETS, publish, write_tweets
from spark_stretch.testing.processes import driver_env, kill_driver


# The functions below are shipped by value (Python workers and stretch instances cannot import
# this test module), native and stretch alike.
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SESSION_OUT = "user string, start long, end long, n long, closed boolean, wm long"
SESSION_STATE = "start long, end long, n long"
GAP_MS = 5_000


def _ms(ts) -> int:
    return int(pd.Timestamp(ts).value // 1_000_000)


def sessions(key, pdfs, state):
    """Sessionization: a session closes GAP_MS of event time after its last event."""
    wm = state.getCurrentWatermarkMs()
    if state.hasTimedOut:
        start, end, n = state.get
        state.remove()
        yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                            "closed": [True], "wm": [wm]})
        return
    start, end, n = state.get if state.exists else (None, None, 0)
    for pdf in pdfs:
        lo, hi = _ms(pdf["ts"].min()), _ms(pdf["ts"].max())
        start = lo if start is None else min(start, lo)
        end = hi if end is None else max(end, hi)
        n += len(pdf)
    state.update((start, end, n))
    state.setTimeoutTimestamp(max(end + GAP_MS, wm))
    yield pd.DataFrame({"user": [key[0]], "start": [start], "end": [end], "n": [n],
                        "closed": [False], "wm": [wm]})


SESSION_ARGS = (sessions, SESSION_OUT, SESSION_STATE, "Update", GroupStateTimeout.EventTimeTimeout)


def running_count(key, pdfs, state):
    n = state.get[0] if state.exists else 0
    words = 0
    for pdf in pdfs:
        n += len(pdf)
        words += int(pdf["len"].sum())
    state.update((n,))
    yield pd.DataFrame({"user": [key[0]], "n": [n], "words": [words]})


def source(spark, src, watermark=True):
    df = spark.readStream.schema(TWEETS).option("maxFilesPerTrigger", 1).parquet(str(src))
    return df.withWatermark("ts", "10 seconds") if watermark else df


def run_native(native_df, out: Path, mode="update", checkpoint=None, expect_failure=False):
    """The native query into Delta: update mode through foreachBatch (Delta's streaming sink has
    no update mode) with txnAppId/txnVersion, append mode straight into Delta."""
    ckpt = str(checkpoint or str(out) + "-ckpt")
    w = native_df.writeStream.outputMode(mode).option("checkpointLocation", ckpt) \
        .trigger(availableNow=True)
    if mode == "update":
        def write(batch, batch_id):
            batch.write.format("delta").mode("append").option("txnAppId", "native") \
                .option("txnVersion", batch_id).save(str(out))
        q = w.foreachBatch(write).start()
    else:
        q = w.format("delta").start(str(out))
    if expect_failure:
        with pytest.raises(StreamingQueryException) as err:
            q.awaitTermination(300)
        return err.value
    q.awaitTermination()
    return None


def start_stretch(g, out: Path, mode="update", checkpoint=None, **trigger):
    return (g.writeStream.outputMode(mode).format("delta")
            .option("checkpointLocation", str(checkpoint or str(out) + "-ckpt"))
            .trigger(**(trigger or {"availableNow": True})).start(str(out)))


def run_stretch(g, out: Path, mode="update", checkpoint=None):
    q = start_stretch(g, out, mode, checkpoint)
    q.awaitTermination()
    return q


def read(spark, out):
    return spark.read.format("delta").load(str(out))


def equal(got, want):
    assert want.count() > 0
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                       ignore_metadata=True)


def _both(spark, src, args, tmp_path):
    """(stretch, native) tables of ``groupBy("user")`` with ``args``, update mode, no watermark."""
    run_native(source(spark, src, False).groupBy("user").applyInPandasWithState(*args),
               tmp_path / "n")
    run_stretch(source(spark, src, False).groupBy("user").stretchApplyInPandasWithState(*args),
                tmp_path / "o")
    return read(spark, tmp_path / "o"), read(spark, tmp_path / "n")


def _shm_dirs():
    return set(Path("/dev/shm").glob("stretch-*")) if Path("/dev/shm").is_dir() else set()


@pytest.fixture(scope="module")
def stream(spark, tmp_path_factory):
    """Six one-file micro-batches with late rows, and native sessionization over them."""
    tmp = tmp_path_factory.mktemp("grouped")
    src = write_tweets(tmp / "src", 720, files=6, rate=12.0, users=150, vocab=30,
                       late_fraction=0.04, late_by_s=20.0, jitter_s=4.0, seed=7)
    args = SESSION_ARGS
    run_native(source(spark, src).groupBy("user").applyInPandasWithState(*args), tmp / "native")
    return src, args, read(spark, tmp / "native")


def _committed(checkpoint: Path):
    """The batches a query's commit log holds."""
    return sorted(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())


def test_stretch_aggregate_is_the_same_method_under_its_first_name(monkeypatch):
    # groupBy(...).stretchAggregate(func, ...), the drop-in's first name, is kept as an alias:
    # one function on GroupedData, so both spellings run the same code with the same arguments.
    # (DataFrame.stretchAggregate, the aggregation dialect, is another method.)
    assert GroupedData.stretchAggregate is GroupedData.stretchApplyInPandasWithState
    assert GroupedData.stretchAggregate is not DataFrame.stretchAggregate
    calls = []
    monkeypatch.setattr(spark_stretch.api, "stretch_apply_in_pandas_with_state",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or len(calls))
    args = ("gd", running_count, "user string, n long", "n long", "Update",
            GroupStateTimeout.NoTimeout)
    assert GroupedData.stretchApplyInPandasWithState(*args, parallelism=2) == 1
    assert GroupedData.stretchAggregate(*args, parallelism=2) == 2
    assert calls == [(args, {"parallelism": 2})] * 2


def test_sessionization_event_time_timeout_equals_native(spark, stream, tmp_path):
    src, args, want = stream
    before = _shm_dirs()
    q = run_stretch(source(spark, src).groupBy("user")
                    .stretchApplyInPandasWithState(*args, parallelism=2), tmp_path / "o")
    got = read(spark, tmp_path / "o")
    equal(got, want)
    # timeouts fired (with data batches and in the final no-data batch), late rows were dropped,
    # the watermark each call saw is Spark's
    assert got.where("closed").count() > 0
    m = q.metrics()
    assert m["engine"]["late_rows"] > 0 and m["engine"]["timeout_calls"] > 0
    # six batches with data and Spark's no-data batch after them (native's: the same)
    assert m["batches"] == 7 and _committed(tmp_path / "o-ckpt") == list(range(7))
    assert _committed(src.parent / "native-ckpt") == list(range(7))
    assert [p for p in m["plans"] if "Exchange" in p] == []
    assert _shm_dirs() <= before  # the state directory in /dev/shm went with the query


def test_stretch_of_apply_in_pandas_with_state_as_written_equals_native(spark, stream,
                                                                         tmp_path):
    """``stretch(df)`` over ``groupBy(...).applyInPandasWithState(...)`` as written for Spark
    (event-time timeouts, a watermark): the drop-in on the engine, native's rows."""
    src, args, want = stream
    q = run_stretch(spark_stretch.stretch(
        source(spark, src).groupBy("user").applyInPandasWithState(*args), parallelism=2,
        buckets=64), tmp_path / "o")
    equal(read(spark, tmp_path / "o"), want)
    m = q.metrics()
    assert m["engine"]["timeout_calls"] > 0 and m["engine"]["late_rows"] > 0


def test_running_count_no_timeout_equals_native(spark, tmp_path):
    src = write_tweets(tmp_path / "src", 300, files=2, rate=10.0, users=30, vocab=30, seed=3)
    args = (running_count, "user string, n long, words long", "n long", "Update",
            GroupStateTimeout.NoTimeout)
    equal(*_both(spark, src, args, tmp_path))


def test_state_removal_and_multi_column_key_equal_native(spark, tmp_path):
    # Key (user, len): a tuple of two numpy values; the state is removed every 2nd row of a key,
    # so keys start again from nothing.
    def fn(key, pdfs, state):
        n = state.get[0] if state.exists else 0
        rows = []
        for pdf in pdfs:
            for _ in range(len(pdf)):
                n += 1
                if n == 2:
                    rows.append((key[0], int(key[1]), type(key[1]).__name__, n))
                    n = 0
        if n == 0:
            state.remove()
        else:
            state.update((n,))
        yield pd.DataFrame(rows, columns=["user", "len", "t", "n"])

    src = write_tweets(tmp_path / "src", 400, files=2, rate=10.0, users=6, vocab=30,
                       min_words=8, max_words=10, seed=4)
    args = (fn, "user string, len long, t string, n long", "n long", "Update",
            GroupStateTimeout.NoTimeout)
    run_native(source(spark, src, False).groupBy("user", "len").applyInPandasWithState(*args),
               tmp_path / "n")
    q = run_stretch(source(spark, src, False).groupBy("user", "len")
                    .stretchApplyInPandasWithState(*args), tmp_path / "o")
    want = read(spark, tmp_path / "n")
    equal(read(spark, tmp_path / "o"), want)
    assert {r.t for r in want.select("t").distinct().collect()} == {"int64"}
    assert q.metrics()["engine"]["state_keys"] < 6 * 3  # removed keys are gone


def test_append_mode_equals_native(spark, tmp_path):
    src = write_tweets(tmp_path / "src", 300, files=2, rate=10.0, users=30, vocab=30, seed=5)
    args = (running_count, "user string, n long, words long", "n long", "Append",
            GroupStateTimeout.NoTimeout)
    run_native(source(spark, src, False).groupBy("user").applyInPandasWithState(*args),
               tmp_path / "n", mode="append")
    run_stretch(source(spark, src, False).groupBy("user").stretchApplyInPandasWithState(*args),
                tmp_path / "o", mode="append")
    equal(read(spark, tmp_path / "o"), read(spark, tmp_path / "n"))
    # the output mode must match the function's, as for native (Spark's own check and message)
    g = source(spark, src, False).groupBy("user").stretchApplyInPandasWithState(*args)
    with pytest.raises(Exception, match="applyInPandasWithState in append mode is not supported "
                                        "with Update output mode"):
        start_stretch(g, tmp_path / "x", mode="update")


def timeout_soon_or_never(key, pdfs, state):
    """A processing-time timeout whose outcome does not depend on the clock: users with an even
    number time out 1 ms after their batch (so at the next batch without their data; batches are
    far more than 1 ms apart), the others after a day (never, in a test)."""
    if state.hasTimedOut:
        (n,) = state.get
        state.remove()
        yield pd.DataFrame({"user": [key[0]], "n": [n], "timed_out": [True]})
        return
    n = (state.get[0] if state.exists else 0) + sum(len(p) for p in pdfs)
    state.update((n,))
    state.setTimeoutDuration(1 if int(key[0][1:]) % 2 == 0 else 86_400_000)
    yield pd.DataFrame({"user": [key[0]], "n": [n], "timed_out": [False]})


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_processing_time_timeout_equals_native(spark, tmp_path):
    # The real clock on both sides, processing-time triggers (native availableNow never ends with
    # ProcessingTimeTimeout: every batch asks for another). Both run until the files are done and
    # a no-data batch (native) / idle flush (stretch) has timed the even users out, then stop.
    files = 3
    src = write_tweets(tmp_path / "src", 180, files=files, rate=10.0, users=40, vocab=30, seed=8)
    args = (timeout_soon_or_never, "user string, n long, timed_out boolean", "n long", "Update",
            GroupStateTimeout.ProcessingTimeTimeout)

    def write(batch, batch_id):
        batch.write.format("delta").mode("append").option("txnAppId", "native") \
            .option("txnVersion", batch_id).save(str(tmp_path / "n"))

    def until(cond, what):
        deadline = time.time() + 180
        while not cond():
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    nq = (source(spark, src, False).groupBy("user").applyInPandasWithState(*args).writeStream
          .outputMode("update").foreachBatch(write)
          .option("checkpointLocation", str(tmp_path / "n-ckpt"))
          .trigger(processingTime="300 milliseconds").start())
    try:  # batches 0..files-1 have data; files and files+1 are no-data batches
        until(lambda: (nq.lastProgress or {}).get("batchId", -1) >= files + 1, "native batches")
    finally:
        nq.stop()
    sq = start_stretch(source(spark, src, False).groupBy("user")
                       .stretchApplyInPandasWithState(*args), tmp_path / "o",
                       processingTime="300 milliseconds")
    try:  # (the same batches: Spark runs the drop-in's no-data batches as it runs native's)
        until(lambda: (sq.lastProgress or {}).get("batchId", -1) >= files + 1, "stretch batches")
    finally:
        sq.stop()
    want = read(spark, tmp_path / "n")
    assert want.where("timed_out").count() > 0 and want.where("NOT timed_out").count() > 0
    equal(read(spark, tmp_path / "o"), want)


def _batch_files(checkpoint: Path, last: int) -> dict:
    """The file each micro-batch 0..``last`` of a query read (one file a batch, or none), from
    Spark's offset log and its file source's log."""
    def entry(path):
        return [json.loads(line) for line in path.read_text().splitlines()[1:]]

    out, seen = {}, -1
    for b in range(last + 1):
        offset = entry(checkpoint / "offsets" / str(b))[-1]["logOffset"]
        if offset > seen:
            (f,) = entry(checkpoint / "sources" / "0" / str(offset))
            out[b] = Path(f["path"].removeprefix("file:"))
        seen = offset
    return out


def test_processing_time_timeout_against_sequential_oracle(spark, tmp_path):
    # The test clock gives batch N the time start + N * step; Spark runs a no-data batch on
    # every trigger without data (ProcessingTimeTimeout), as it does natively. The oracle: the
    # rules of FlatMapGroupsWithState over the batches Spark ran (its offset log says which
    # file each read), at the test clock's times.
    start, step, duration = 1_000_000, 10_000, 15_000

    def fn(key, pdfs, state):
        now = state.getCurrentProcessingTimeMs()
        if state.hasTimedOut:
            (n,) = state.get
            state.remove()
            yield pd.DataFrame({"user": [key[0]], "n": [n], "timed_out": [True], "now": [now]})
            return
        n = (state.get[0] if state.exists else 0) + sum(len(p) for p in pdfs)
        state.update((n,))
        state.setTimeoutDuration(duration)
        yield pd.DataFrame({"user": [key[0]], "n": [n], "timed_out": [False], "now": [now]})

    files = 4
    src = write_tweets(tmp_path / "src", 160, files=files, rate=10.0, users=60, vocab=30, seed=6)
    spark.conf.set("spark.stretch.testClockMs", f"{start}+{step}")
    try:
        g = source(spark, src, False).groupBy("user").stretchApplyInPandasWithState(
            fn, "user string, n long, timed_out boolean, now long", "n long", "Update",
            GroupStateTimeout.ProcessingTimeTimeout)
        q = start_stretch(g, tmp_path / "o", processingTime="200 milliseconds")
    finally:
        spark.conf.unset("spark.stretch.testClockMs")
    ckpt = tmp_path / "o-ckpt"
    deadline = time.time() + 180
    try:  # every key's timeout has passed two batches after its last rows
        while len(_committed(ckpt)) < files + 2 or \
                max(_batch_files(ckpt, _committed(ckpt)[-1])) + 2 > _committed(ckpt)[-1]:
            assert q.isActive and time.time() < deadline, q.exception()
            time.sleep(0.2)
    finally:
        q.stop()
    last = _committed(ckpt)[-1]
    read_by = _batch_files(ckpt, last)
    want, state = [], {}
    for b in range(last + 1):
        now = start + b * step
        if b in read_by:
            users = pq.read_table(read_by[b]).column("user").to_pylist()
            for u in sorted(set(users)):
                n = state.get(u, (0, None))[0] + users.count(u)
                state[u] = (n, now + duration)
                want.append((u, n, False, now))
        for u, (n, timeout) in list(state.items()):
            if timeout < now:
                del state[u]
                want.append((u, n, True, now))
    got = sorted(tuple(r) for r in read(spark, tmp_path / "o").where(
        f"now <= {start + last * step}").collect())  # (a batch after the last committed one)
    assert sorted(read_by) == list(range(files)) and got == sorted(want)
    assert any(w[2] for w in want)


@pytest.mark.slow  # 4 / 1 query runs; with -m slow
def test_restart_from_checkpoint_mid_stream_equals_native(spark, stream, tmp_path):
    # Stop after 2 files, add 2 more, restart from the checkpoint: the same as native, run (and
    # restarted) the same way.
    src, args, _ = stream
    live = tmp_path / "live"
    live.mkdir()
    files = sorted(Path(src).glob("*.parquet"))
    for phase in (files[:2], files[2:4]):
        for f in phase:
            publish(f, live)
        run_native(source(spark, live).groupBy("user").applyInPandasWithState(*args),
                   tmp_path / "n")
        run_stretch(source(spark, live).groupBy("user").stretchApplyInPandasWithState(*args),
                    tmp_path / "o")
    equal(read(spark, tmp_path / "o"), read(spark, tmp_path / "n"))
    # the same micro-batches as native's, Spark's no-data batches included
    committed = [sorted(int(p.name) for p in (tmp_path / f"{x}-ckpt" / "commits").iterdir()
                        if p.name.isdigit()) for x in ("o", "n")]
    assert committed[0] == committed[1] and len(committed[0]) >= 4, committed


def _to_format_2(checkpoint: Path, tmp: Path) -> int:
    """Rewrite a drop-in checkpoint's engine state as spark-stretch 0.18 wrote it (format 2: one
    pickled dict ``key -> (value, timeout)`` per bucket file, a full checkpoint of the last
    batch only); returns that batch."""
    import pickle
    import shutil

    from spark_stretch.engine.keyed import KeyedStore, unpack_snapshot

    state = checkpoint / "stretch" / "state"
    last = max(int(d.name) for d in state.iterdir() if d.name.isdigit())
    chain = [last]
    while json.loads((state / str(chain[0]) / "grouped.json").read_text())["kind"] == "delta":
        chain.insert(0, json.loads((state / str(chain[0]) / "grouped.json").read_text())["parent"])
    (tmp / "kv").mkdir()
    unpack_snapshot(state / str(chain[0]) / "state.mdb.zst", tmp / "kv" / "data.mdb")
    kv = KeyedStore(tmp / "kv")
    import pyarrow.ipc as ipc
    for b in chain[1:]:
        for f in sorted((state / str(b)).glob("changes-*.arrow")):
            kv.apply(ipc.open_file(str(f)).read_all())
    buckets = {}
    for kb, (key, value, timeout) in kv.entries():
        buckets.setdefault(int.from_bytes(kb[:2], "big"), {})[key] = (value, timeout)
    kv.close()
    meta = json.loads((state / str(last) / "grouped.json").read_text())
    for d in state.iterdir():
        shutil.rmtree(d)
    (state / str(last)).mkdir()
    for b, d in buckets.items():
        (state / str(last) / f"b{b:05d}.pkl").write_bytes(pickle.dumps(d, protocol=5))
    meta.update(format=2, kind="full", parent=None)
    (state / str(last) / "grouped.json").write_text(json.dumps(meta))
    return last


@pytest.mark.slow  # 4 query runs; with -m slow
def test_a_checkpoint_of_pickled_buckets_is_converted_and_goes_on_equal_to_native(
        spark, stream, tmp_path):
    # A query checkpointed by spark-stretch 0.18 (format 2) restarts on this version: its state
    # is converted into the store (timeouts included: the sessions close), the next checkpoint
    # is written whole in format 4, and the table equals native's, run the same way.
    src, args, _ = stream
    live = tmp_path / "live"
    live.mkdir()
    files = sorted(Path(src).glob("*.parquet"))
    for phase, fs in enumerate((files[:3], files[3:])):
        for f in fs:
            publish(f, live)
        run_native(source(spark, live).groupBy("user").applyInPandasWithState(*args),
                   tmp_path / "n")
        if phase == 1:
            last = _to_format_2(tmp_path / "o-ckpt", tmp_path)
        run_stretch(source(spark, live).groupBy("user").stretchApplyInPandasWithState(*args),
                    tmp_path / "o")
    equal(read(spark, tmp_path / "o"), read(spark, tmp_path / "n"))
    state = tmp_path / "o-ckpt" / "stretch" / "state"
    after = sorted(int(d.name) for d in state.iterdir() if d.name.isdigit() and int(d.name) > last)
    meta = json.loads((state / str(after[0]) / "grouped.json").read_text())
    assert (meta["format"], meta["kind"]) == (4, "full")
    assert (state / str(after[0]) / "state.mdb.zst").exists()


def test_a_checkpoint_of_an_unknown_format_is_refused_saying_how_to_go_on(spark, stream,
                                                                         tmp_path):
    src, args, _ = stream
    live = tmp_path / "live"
    live.mkdir()
    publish(sorted(Path(src).glob("*.parquet"))[0], live)
    g = lambda: source(spark, live).groupBy("user").stretchApplyInPandasWithState(*args)  # noqa
    run_stretch(g(), tmp_path / "o")
    state = tmp_path / "o-ckpt" / "stretch" / "state"
    for d in state.iterdir():
        if d.name.isdigit():
            meta = json.loads((d / "grouped.json").read_text())
            (d / "grouped.json").write_text(json.dumps({**meta, "format": 1}))
    publish(sorted(Path(src).glob("*.parquet"))[1], live)
    q = start_stretch(g(), tmp_path / "o")
    with pytest.raises(StreamingQueryException, match=r"(?s)has format 1; this version of "
                       r"spark-stretch reads format 2, 3 or 4\. Restart the query with a new "
                       r"checkpointLocation"):
        q.awaitTermination(300)


def test_user_function_raises_fails_query_with_the_cause(spark, stream, tmp_path):
    # The function misuses GroupState in batch 2 (get after remove): the query fails with a
    # StreamingQueryException carrying the Python traceback, the same exception type and message
    # as native, and the table holds exactly batches 0 and 1.
    src, _, _ = stream

    def fails_in_batch_2(key, pdfs, state):
        n = sum(len(p) for p in pdfs)
        state.update((n,))
        yield pd.DataFrame({"user": [key[0]], "n": [n]})
        # 10 s of events a file, 10 s delay: W_1 < 4 s, W_2 >= 10 s
        if state.getCurrentWatermarkMs() >= 10_000:
            state.remove()
            state.get  # PySparkValueError: [STATE_NOT_EXISTS]

    args = (fails_in_batch_2, "user string, n long", "n long", "Update",
            GroupStateTimeout.EventTimeTimeout)
    native_err = run_native(source(spark, src).groupBy("user").applyInPandasWithState(*args),
                            tmp_path / "n", expect_failure=True)
    q = start_stretch(source(spark, src).groupBy("user").stretchApplyInPandasWithState(*args),
                      tmp_path / "o")
    with pytest.raises(StreamingQueryException) as err:
        q.awaitTermination(300)
    msg = str(err.value)
    line = ("PySparkValueError: [STATE_NOT_EXISTS] State is either not defined or has already "
            "been removed.")
    assert line in msg and line in str(native_err)
    assert "in fails_in_batch_2" in msg and "state.get" in msg  # the user's frame
    assert not q.isActive
    got, want = read(spark, tmp_path / "o"), read(spark, tmp_path / "n")
    equal(got, want)
    committed = sorted(int(p.name) for p in (tmp_path / "o-ckpt" / "commits").iterdir()
                       if p.name.isdigit())
    assert committed == [0, 1]


def test_group_state_misuse_same_errors_as_native(spark, tmp_path):
    # Every misuse is caught inside the function and reported as a row: the same exception types
    # and messages (pyspark's own GroupState), the same watermark, for every key and batch.
    def misuse(key, pdfs, state):
        for _ in pdfs:
            pass
        tries = {
            "get": lambda: state.get,
            "update_none": lambda: state.update(None),
            "duration_without_ptt": lambda: state.setTimeoutDuration(1000),
            "duration_str": lambda: state.setTimeoutDuration("1 hour"),
            "timestamp_negative": lambda: state.setTimeoutTimestamp(-5),
            "timestamp_before_wm": lambda: state.setTimeoutTimestamp(1),
            "watermark": lambda: state.getCurrentWatermarkMs(),
            "get_after_remove": lambda: (state.remove(), state.get),
        }
        rows = []
        for name, call in tries.items():
            try:
                r = call()
                rows.append((key[0], name, f"ok {r!r}"[:60]))
            except Exception as e:  # noqa: BLE001
                rows.append((key[0], name, f"{type(e).__module__}.{type(e).__name__}: {e}"))
        state.update((1,))
        yield pd.DataFrame(rows, columns=["user", "what", "result"])

    src = write_tweets(tmp_path / "src", 60, files=2, rate=1.0, users=3, vocab=10, seed=8)
    args = (misuse, "user string, what string, result string", "n long", "Update",
            GroupStateTimeout.EventTimeTimeout)
    run_native(source(spark, src).groupBy("user").applyInPandasWithState(*args), tmp_path / "n")
    run_stretch(source(spark, src).groupBy("user").stretchApplyInPandasWithState(*args),
                tmp_path / "o")
    want = read(spark, tmp_path / "n")
    equal(read(spark, tmp_path / "o"), want)
    results = {r.result.split(":")[0] for r in want.collect()}
    assert {"pyspark.errors.exceptions.base.PySparkValueError",
            "pyspark.errors.exceptions.base.PySparkTypeError",
            "pyspark.errors.exceptions.base.PySparkRuntimeError"} <= results


def _wait_batches(q, n, timeout=180):
    deadline = time.time() + timeout
    while q.metrics()["batches"] < n:
        assert q.isActive or q.metrics()["batches"] >= n, q.exception()
        assert time.time() < deadline, f"stuck before batch {n}"
        time.sleep(0.05)


def test_reconfigure_2_then_1_mid_stream_equals_native(spark, stream, tmp_path):
    src, args, want = stream
    g = source(spark, src).groupBy("user").stretchApplyInPandasWithState(
        *args, parallelism=1, max_parallelism=2, buckets=64)
    q = start_stretch(g, tmp_path / "o")
    recs = []
    for after, k in ((2, 2), (4, 1)):  # while the query runs: no stop, no restart
        _wait_batches(q, after)
        recs.append(q.reconfigure(parallelism=k))
    q.awaitTermination()
    assert q.exception() is None
    equal(read(spark, tmp_path / "o"), want)
    assert [r["parallelism"] for r in recs] == [2, 1] and [r["epoch"] for r in recs] == [1, 2]
    assert all(r["switch_ms"] < 100 and r["state_copied_bytes"] == 0 for r in recs), recs
    assert recs[0]["moved_buckets"] == 32 and recs[1]["moved_buckets"] == 32
    # batches run between the two switches used both instances
    per = [b["instances"] for b in q.metrics()["batch_times"]
           if recs[0]["after_batch"] < b["batch"] <= recs[1]["after_batch"]]
    assert per and all(len(p) == 2 for p in per)


@pytest.mark.slow  # 4 / 1 query runs; with -m slow
def test_engine_killed_mid_batch_is_restarted_from_checkpoint(spark, stream, tmp_path,
                                                              monkeypatch):
    src, args, want = stream
    monkeypatch.setenv(ENV, f"kill@step:3:{tmp_path / 'fired'}")
    q = run_stretch(source(spark, src).groupBy("user").stretchApplyInPandasWithState(*args),
                    tmp_path / "o")
    assert (tmp_path / "fired").exists()
    restarts = q.metrics()["engine_restarts"]
    assert len(restarts) == 1 and restarts[0]["resumed_from"] == 2, restarts
    assert f"died (exit status -{int(signal.SIGKILL)}) during batch 3" in restarts[0]["cause"]
    equal(read(spark, tmp_path / "o"), want)


@pytest.mark.slow  # a driver process started and killed, then a restart; with -m slow
def test_driver_killed_mid_stream_then_restart_is_exact(spark, stream, tmp_path):
    # The drop-in runs in a driver process killed (-9, its JVM too) once its engine checkpointed
    # batch 2; its engine and instances die with it, and a restart from the checkpoint gives
    # native's table: nothing lost, nothing written twice.
    import subprocess

    src, args, want = stream
    env = driver_env(tmp_path, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("grouped_driver_job.py")),
                             str(src), str(tmp_path / "o"), str(tmp_path / "o-ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    saved = tmp_path / "o-ckpt" / "stretch" / "state" / "2" / "grouped.json"
    deadline = time.time() + 300
    while not saved.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "the driver never checkpointed batch 2"
        time.sleep(0.02)
    kill_driver(proc)
    assert _committed(tmp_path / "o-ckpt")[-1] < 5, "the run ended before the kill"
    run_stretch(source(spark, src).groupBy("user").stretchApplyInPandasWithState(*args),
                tmp_path / "o")
    equal(read(spark, tmp_path / "o"), want)


def waits_while(armed: str, waiting: str):
    """``running_count``, but while file ``armed`` exists, and for 90 s after it was made at
    most, a call writes ``waiting`` and waits (a step that takes minutes, as a million keys'
    does; bounded, so that a stop that waits for the step fails the test instead of hanging)."""
    def func(key, pdfs, state):
        while True:
            try:
                if time.time() > os.path.getmtime(armed) + 90:
                    break
            except FileNotFoundError:
                break
            open(waiting, "w").close()
            time.sleep(0.05)
        yield from running_count(key, pdfs, state)
    return func


@pytest.mark.slow  # 3 query runs; with -m slow
def test_stop_during_a_long_step_returns_at_once_and_a_restart_is_exact(spark, stream,
                                                                       tmp_path):
    # q.stop() interrupts the query's thread, which waits for the engine's step (its instances
    # in the function): the step is given up on the engine, so stop() returns in seconds, not
    # when the function would end. A restart redoes the batch from the checkpoint: the table
    # is native's, nothing lost or written twice.
    src, _, _ = stream
    files = sorted(Path(src).glob("*.parquet"))
    live = tmp_path / "live"
    live.mkdir()
    armed, waiting = tmp_path / "armed", tmp_path / "waiting"
    rest = ("user string, n long, words long", "n long", "Update", GroupStateTimeout.NoTimeout)

    def g(func):
        return source(spark, live, False).groupBy("user").stretchApplyInPandasWithState(
            func, *rest)

    for f in files[:2]:
        publish(f, live)
    q = start_stretch(g(waits_while(str(armed), str(waiting))), tmp_path / "o",
                      processingTime="1 second")
    try:
        _wait_batches(q, 2)
        armed.touch()
        publish(files[2], live)
        deadline = time.time() + 120
        while not waiting.exists():
            assert q.isActive and time.time() < deadline, q.exception()
            time.sleep(0.05)
        t0 = time.monotonic()
        q.stop()
        took = time.monotonic() - t0
    finally:
        armed.unlink(missing_ok=True)
        q.stop()
    assert took < 30, f"stop() took {took:.1f} s"
    assert q.exception() is None
    assert _committed(tmp_path / "o-ckpt")[-1] == 1  # (batch 2 was not committed)
    for f in files[3:]:
        publish(f, live)
    run_stretch(g(running_count), tmp_path / "o")
    run_native(source(spark, src, False).groupBy("user").applyInPandasWithState(
        running_count, *rest), tmp_path / "n")
    equal(read(spark, tmp_path / "o"), read(spark, tmp_path / "n"))


def dies_once_for_some_keys(markers: str, how: str):
    """``sessions``, but the instance process dies (``how``: ``exit``, ``kill``) the first
    time a few keys are called with state (a later batch, or their timeout in the last no-data
    batch): one marker file per key, so a key dies at most once."""
    def func(key, pdfs, state):
        import zlib

        user = key[0]
        if state.exists and zlib.crc32(user.encode()) % 40 == 0:
            try:
                os.close(os.open(os.path.join(markers, user), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                if how == "exit":
                    os._exit(13)
                os.kill(os.getpid(), signal.SIGKILL)
        yield from sessions(key, pdfs, state)
    return func


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_dying_instance_reruns_its_share_alone_and_equals_native(spark, stream, tmp_path, how):
    # Instances die in the middle of batches (after other keys of theirs changed state in
    # memory) and of the last no-data batch: each is started again and runs its share again,
    # the query never restarts, and the table is native's (which never dies).
    src, args, want = stream
    markers = tmp_path / "died"
    markers.mkdir()
    before = _shm_dirs()
    func = dies_once_for_some_keys(str(markers), how)
    q = run_stretch(source(spark, src).groupBy("user").stretchApplyInPandasWithState(
        func, *args[1:], parallelism=2), tmp_path / "o")
    assert q.exception() is None
    equal(read(spark, tmp_path / "o"), want)
    deaths = len(list(markers.iterdir()))
    m = q.metrics()
    assert deaths >= 2 and m["instance_retries"] == deaths == m["engine"]["instance_retries"]
    assert "engine_restarts" not in m and m["batches"] == 7  # (and the no-data batch)
    retried = [r for b in m["batch_times"] for r in b.get("retries", [])]
    status = "exited with status 13" if how == "exit" else \
        f"was killed by signal {int(signal.SIGKILL)}"
    assert retried and all(r["died"] and status in r["cause"] for r in retried), retried
    assert _shm_dirs() <= before


def test_an_instance_that_always_dies_fails_the_query_after_bounded_retries(spark, tmp_path):
    def dies(key, pdfs, state):
        n = sum(len(p) for p in pdfs)
        if state.exists:  # second batch of a key
            os._exit(7)
        state.update((n,))
        yield pd.DataFrame({"user": [key[0]], "n": [n]})

    before = _shm_dirs()
    src = write_tweets(tmp_path / "src", 60, files=2, rate=10.0, users=2, vocab=10, seed=9)
    spark.conf.set("spark.stretch.instanceMaxFailures", "2")
    try:
        t0 = time.monotonic()
        q = start_stretch(source(spark, src, False).groupBy("user").stretchApplyInPandasWithState(
            dies, "user string, n long", "n long", "Update", GroupStateTimeout.NoTimeout,
            parallelism=1), tmp_path / "o")
    finally:
        spark.conf.unset("spark.stretch.instanceMaxFailures")  # (read when the query starts)
    with pytest.raises(StreamingQueryException, match=r"(?s)stretch instance 0 \(pid \d+\) "
                       r"exited with status 7 during batch 1 \(run 2\).*instance 0 died 2 "
                       r"times running its share of batch 1: "
                       r"spark.stretch.instanceMaxFailures=2"):
        q.awaitTermination(300)
    assert time.monotonic() - t0 < 120
    assert read(spark, tmp_path / "o").count() == 2  # batch 0, committed
    assert _shm_dirs() <= before
