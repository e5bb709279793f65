"""stretchAggregate vs native Spark on the same tweet stream, side by side in one run.

    python python/bench/spark.py [--tweets 1000000] [--files 10] [--queries wordcount,paircount-L]
                                 [--repeat 1] [--source parquet|delta] [--json]

``composite``, ``session`` and ``newer`` (``AS_WRITTEN``) are queries as Spark users write
them: a composite-key sum/avg/max over a sliding window, a per-user session window (2 s gap; a
user tweets about once a second; ``session_complete``: the same in complete mode, every session
each batch), and the newer aggregate functions per user and sliding window (stddev, var_pop,
first, last, max_by, min_by, approx_count_distinct, count_if, a decimal sum; doubles compared
within 1e-9; over the same tweets without event-time jitter, where native Spark's first/last
are defined as the engine's), run
natively and wrapped with ``spark_stretch.stretch(df)``, both into Delta (the engine appends
stretch's rows itself), alternated ``--repeat`` times, medians, outputs checked equal.

For each query the same parquet tweet stream (``--files`` files = micro-batches, availableNow,
local[2]) goes through (1) the native query (``groupBy(window, explode(keys)).count()``, append
mode), (2) ``stretchAggregate``, both into Delta, (2b) ``stretchAggregate`` with
``spark.stretch.delta.directWrite=false`` (Spark reads the output back and writes it, instead of
the engine appending it to Delta itself), and (3) the ingest floor: the same stream read and
dropped (``noop`` sink), nothing else. The floor and (2) are timed after one untimed warm-up
pass each (the JVM's first pass over the files and the shim's code: class loading, JIT). Outputs of (1), (2) and (2b) are checked equal (exceptAll
both ways). Reported: input tweets per second. With ``--repeat N`` the floor and (2) run N times
each, alternated (floor, stretch, floor, stretch, ...), and their medians are reported: on a
shared machine one run of either moves by 10-20%. ``--source delta`` reads the same tweets from a
Delta table written a commit per file (``maxFilesPerTrigger=1``: the same micro-batches), for
all four runs.

Fair set-up for native Spark: the same session (local[2], spark.driver.memory=4g instead of the
1 GB default that makes its state store thrash in GC), spark.sql.shuffle.partitions=2 (one per
core; the default 200 is far slower here), the default HDFS-backed state store (in memory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import spark_stretch
from spark_stretch.testing import write_tweets
from workdir import bench_run

SCHEMA = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"
QUERIES = {
    "wordcount": lambda: F.col("words"),
    "paircount-L": lambda: spark_stretch.pairs("words", distance=3),
    "paircount-M": lambda: spark_stretch.pairs("words", distance=10),
    "paircount-H": lambda: spark_stretch.pairs("words"),
}
WINDOW = ("120 seconds", "60 seconds")
# Queries as Spark users write them: native vs the same DataFrame wrapped with stretch(df)
AS_WRITTEN = {
    "composite": lambda df: df.groupBy(F.window("ts", *WINDOW), "user",
                                       F.size("words").alias("n_words"))
    .agg(F.sum("len").alias("s"), F.avg("len").alias("a"), F.max("len").alias("m")),
    "session": lambda df: df.groupBy(F.session_window("ts", "2 seconds"), "user")
    .agg(F.count("*").alias("n"), F.sum("len").alias("s"), F.max("len").alias("m")),
}
AS_WRITTEN["session_complete"] = AS_WRITTEN["session"]  # (every session each batch)
# The newer aggregate functions (per user and sliding window): stddev and variance (from sums on
# the engine: equal to native's to rounding, compared within 1e-9), first/last, max_by/min_by,
# approx_count_distinct (Spark's HLL++ registers), count_if and an exact decimal sum; over tweets
# in event-time order (SORTED), where Spark's first/last (the first/last row to reach it) are
# the engine's (the earliest/latest by event time)
AS_WRITTEN["newer"] = lambda df: df.groupBy(F.window("ts", *WINDOW), "user").agg(
    F.stddev("len").alias("sd"), F.var_pop("len").alias("vp"), F.first("len").alias("f"),
    F.last("len").alias("l"), F.max_by("len", "ts").alias("mb"),
    F.min_by(F.size("words"), "ts").alias("nb"), F.approx_count_distinct("len").alias("d"),
    F.count_if(F.col("len") > 100).alias("ci"),
    F.sum(F.col("len").cast("decimal(10,2)")).alias("ds"))
MODES = {"session_complete": "complete"}  # output modes other than append
ROUNDED = {"newer"}  # (doubles compared within 1e-9, relative)
SORTED = {"newer"}   # (over tweets without event-time jitter)


def _source(spark, src, fmt="parquet"):
    read = spark.readStream.option("maxFilesPerTrigger", 1)
    read = read.schema(SCHEMA).parquet(str(src)) if fmt == "parquet" \
        else read.format("delta").load(str(src))
    return read.withWatermark("ts", "10 seconds")


def _as_delta(src: Path, dst: Path) -> Path:
    """The parquet files of ``src`` as a Delta table at ``dst``, one commit (one file) each."""
    import pyarrow.parquet as pq
    from deltalake import write_deltalake

    for f in sorted(src.glob("*.parquet")):  # (names grow with event time)
        write_deltalake(str(dst), pq.read_table(f), mode="append")
    return dst


def _timed(start):
    # (untimed: a JVM garbage collection first, so no run collects the one before's garbage)
    SparkSession.getActiveSession().sparkContext._jvm.System.gc()
    t0 = time.perf_counter()
    q = start()
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(q.exception())
    return time.perf_counter() - t0


def _same(a, b, rel: float = 0.0) -> bool:
    """Whether two tables have the same rows (``rel``: their doubles within ``rel`` of each
    other, relative; every other column exactly)."""
    if a.count() != b.count():
        return False
    if not rel:
        return a.exceptAll(b).isEmpty() and b.exceptAll(a).isEmpty()
    doubles = [f.name for f in a.schema if f.dataType.typeName() == "double"]
    exact = [c for c in a.columns if c not in doubles]
    x, y = a.alias("x"), b.alias("y")
    on = [F.col(f"x.{c}").eqNullSafe(F.col(f"y.{c}")) for c in exact]
    off = [F.when(F.col(f"x.{c}").isNull() != F.col(f"y.{c}").isNull(), 1.0).otherwise(
        F.abs(F.col(f"x.{c}") - F.col(f"y.{c}")) / F.greatest(F.abs(F.col(f"y.{c}")),
                                                               F.lit(1e-300)))
        for c in doubles]
    row = x.join(y, on).select(F.count("*").alias("n"), *[
        F.max(F.coalesce(d, F.lit(0.0))).alias(f"d{i}") for i, d in enumerate(off)]).first()
    return row["n"] == a.count() and all((row[f"d{i}"] or 0.0) <= rel
                                         for i in range(len(doubles)))


def _as_written(spark, src, args, work: Path, name: str) -> dict:
    """Native vs ``stretch(df)`` of the same DataFrame (``AS_WRITTEN[name]``), both into Delta,
    alternated ``--repeat`` times (native first in odd rounds, stretch first in even ones) after
    an untimed warm-up of each; medians; outputs equal."""
    def make(wrap):
        df = AS_WRITTEN[name](_source(spark, src, args.source))
        return spark_stretch.stretch(df, parallelism=args.parallelism,
                                     max_parallelism=args.parallelism) if wrap else df

    def run(wrap, tag):
        out = work / f"{name}-{tag}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(f"{out}-ckpt", ignore_errors=True)
        s = _timed(lambda: make(wrap).writeStream.format("delta")
                   .outputMode(MODES.get(name, "append"))
                   .option("checkpointLocation", f"{out}-ckpt")
                   .trigger(availableNow=True).start(str(out)))
        return s, out

    run(False, "native-warmup")
    run(True, "stretch-warmup")
    times = {"native": [], "stretch": []}
    for i in range(args.repeat):
        for kind in (["native", "stretch"] if i % 2 == 0 else ["stretch", "native"]):
            s, _ = run(kind == "stretch", kind)
            times[kind].append(s)
    a = spark.read.format("delta").load(str(work / f"{name}-native"))
    b = spark.read.format("delta").load(str(work / f"{name}-stretch"))
    equal = _same(a, b, rel=1e-9 if name in ROUNDED else 0.0)
    native_s, stretch_s = (statistics.median(v) for v in times.values())
    r = {"native": args.tweets / native_s, "stretch": args.tweets / stretch_s,
         "equal": bool(equal), "rows": a.count(), "native_runs_s": times["native"],
         "stretch_runs_s": times["stretch"]}
    if not args.json:
        print(f"{name:<12} native {r['native']:>10,.0f}  stretch(df) {r['stretch']:>10,.0f} "
              f"tweets/s   stretch/native {native_s / stretch_s:5.2f}x  rows {r['rows']}  "
              f"equal={equal}  runs native {[round(t, 2) for t in times['native']]} stretch "
              f"{[round(t, 2) for t in times['stretch']]}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tweets", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--queries", default=",".join([*QUERIES, *AS_WRITTEN]))
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="floor and stretch runs (medians)")
    ap.add_argument("--source", choices=("parquet", "delta"), default="parquet")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with bench_run("stretch-bench-spark-") as bench:
        _main(args, bench)


def _main(args, bench) -> None:
    work = bench.path
    src = write_tweets(work / "tweets", args.tweets, files=args.files, rate=1000.0, seed=1)
    names = args.queries.split(",")
    ordered = write_tweets(work / "tweets-sorted", args.tweets, files=args.files, rate=1000.0,
                           seed=1, jitter_s=0.0) if SORTED & set(names) else None
    if args.source == "delta":
        src = _as_delta(src, work / "tweets-delta")
        ordered = ordered and _as_delta(ordered, work / "tweets-sorted-delta")
    spark = bench.session(spark_stretch.session(app_name="bench spark",
                                                conf={"spark.sql.shuffle.partitions": "2"}))
    spark.sparkContext.setLogLevel("ERROR")
    report = {"tweets": args.tweets, "files": args.files, "source": args.source, "queries": {}}
    def floor(ckpt):
        return _timed(lambda: _source(spark, src, args.source).writeStream.format("noop")
                      .option("checkpointLocation", str(work / ckpt))
                      .trigger(availableNow=True).start())

    # Warm-up first: the JVM's first pass over the files (class loading, JIT, page cache)
    # would otherwise be charged to the floor alone and flatter stretch / floor.
    floor("warmup-ckpt")
    floors = [floor("floor-ckpt")]
    for name in names:
        if name in AS_WRITTEN:
            report["queries"][name] = _as_written(
                spark, ordered if name in SORTED else src, args, work, name)
            continue
        agg = _source(spark, src, args.source).stretchAggregate(
            keys=QUERIES[name](), window=WINDOW, agg="count",
            parallelism=args.parallelism, max_parallelism=args.parallelism)
        out_n, out_s = work / f"{name}-native", work / f"{name}-stretch"
        native_s = _timed(lambda: agg.native().writeStream.format("delta").outputMode("append")
                          .option("checkpointLocation", str(out_n) + "-ckpt")
                          .trigger(availableNow=True).start(str(out_n)))
        # An untimed warm-up pass, as for the floor: the JVM's first run of the shim's ingest
        # (class loading, JIT) would otherwise be charged to the first timed run alone.
        _timed(lambda: agg.writeStream.format("delta")
               .option("checkpointLocation", str(work / f"{name}-warmup-ckpt"))
               .trigger(availableNow=True).start(str(work / f"{name}-warmup")))
        runs = []
        for i in range(args.repeat):
            if i:  # a fresh table and checkpoint each time; the floor in between
                shutil.rmtree(out_s, ignore_errors=True)
                shutil.rmtree(str(out_s) + "-ckpt", ignore_errors=True)
                shutil.rmtree(work / "floor-ckpt", ignore_errors=True)
                floors.append(floor("floor-ckpt"))
            runs.append(_timed(lambda: agg.writeStream.format("delta")
                               .option("checkpointLocation", str(out_s) + "-ckpt")
                               .trigger(availableNow=True).start(str(out_s))))
        stretch_s, floor_s = statistics.median(runs), statistics.median(floors)
        out_w = work / f"{name}-stretch-sparkwrite"
        spark.conf.set("spark.stretch.delta.directWrite", "false")
        try:
            sparkwrite_s = _timed(lambda: agg.writeStream.format("delta")
                                  .option("checkpointLocation", str(out_w) + "-ckpt")
                                  .trigger(availableNow=True).start(str(out_w)))
        finally:
            spark.conf.unset("spark.stretch.delta.directWrite")
        a = spark.read.format("delta").load(str(out_n))
        equal = True
        for out in (out_s, out_w):
            b = spark.read.format("delta").load(str(out))
            equal = equal and a.count() == b.count() and a.exceptAll(b).isEmpty() \
                and b.exceptAll(a).isEmpty()
        report["queries"][name] = {
            "native": args.tweets / native_s, "stretch": args.tweets / stretch_s,
            "stretch_sparkwrite": args.tweets / sparkwrite_s,
            "floor": args.tweets / floor_s, "equal": bool(equal), "rows": a.count(),
            "stretch_runs_s": runs, "floor_runs_s": list(floors)}
        if not args.json:
            r = report["queries"][name]
            print(f"{name:<12} native {r['native']:>10,.0f}  stretch {r['stretch']:>10,.0f}  "
                  f"(Spark writing: {r['stretch_sparkwrite']:>10,.0f})  "
                  f"floor {r['floor']:>10,.0f} tweets/s   stretch/native "
                  f"{r['stretch'] / r['native']:5.2f}x "
                  f"({r['stretch_sparkwrite'] / r['native']:5.2f}x)  stretch/floor "
                  f"{r['stretch'] / r['floor']:5.2f}  equal={equal}", flush=True)
    if args.json:
        print(json.dumps(report))
    if not all(q["equal"] for q in report["queries"].values()):
        sys.exit("outputs differ between native Spark and stretchAggregate")


if __name__ == "__main__":
    main()
