"""``stretch(df)`` (a native query as written, on the engine inside Spark's plan) vs native Spark
vs ``stretchAggregate``, side by side in one run, into Delta.

    python python/bench/native_spelling.py [--tweets 1000000] [--files 10] [--repeat 3]
                                           [--queries wordcount,composite,fallback]

Queries over the same tweet stream (``--files`` files = micro-batches, availableNow, local[2],
window 120 s sliding by 60 s, watermark 10 s):

- ``wordcount``: ``select(explode(words).alias(word), ts).groupBy(window, word).count()``;
  native, ``stretch(...)`` of the same DataFrame, and ``stretchAggregate(keys="words")`` (whose
  engine appends to Delta itself);
- ``composite``: ``groupBy(window, user, size(words)).agg(sum(len), avg(len), max(len))``;
  native and ``stretch(...)``;
- ``fallback``: ``groupBy(window, user).agg(percentile_approx(len, 0.5), sum(len))``, which the
  engine cannot run: native and ``stretch(...)`` (Spark runs it, after ``stretch`` analysed it
  and warned): what a fallback costs.

Each run is timed from the making of its DataFrame (``stretch(df)`` analyses the plan then) to
the query's end.

Every run's table is checked equal to native's (exceptAll both ways). Each stretch run starts
the engine process, as a query's first run does (the previous run's is waited out), and each run
starts after a JVM garbage collection (untimed). ``--repeat`` rounds, each starting with the next
kind (native, stretch(df), ...; then stretch(df), ..., native), so no kind always runs right
after another (a repeat that is a multiple of 3 gives each kind each place); medians reported.
Fair set-up for native Spark as in
``spark.py``: spark.driver.memory=4g, spark.sql.shuffle.partitions=2, the default state store.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

from pyspark.sql import functions as F

import spark_stretch
from workdir import bench_run
from spark_stretch.driver.engine import HostEngine
from spark_stretch.testing import write_tweets

SCHEMA = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"
def _window():
    return F.window("ts", "120 seconds", "60 seconds")


def _quiet(make):
    """``make()`` with stretch's fallback warning (expected here) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", spark_stretch.FallbackWarning)
        return make()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tweets", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--queries", default="wordcount,composite,fallback")
    args = ap.parse_args()
    with bench_run("stretch-bench-native-") as bench:
        _main(args, bench)


def _main(args, bench) -> None:
    work = bench.path
    src = write_tweets(work / "tweets", args.tweets, files=args.files, rate=1000.0, seed=1)
    spark = bench.session(spark_stretch.session(app_name="bench native spelling",
                                                conf={"spark.sql.shuffle.partitions": "2"}))
    spark.sparkContext.setLogLevel("ERROR")

    def source():
        return (spark.readStream.option("maxFilesPerTrigger", 1).schema(SCHEMA)
                .parquet(str(src)).withWatermark("ts", "10 seconds"))

    def wordcount():
        return (source().select(F.explode("words").alias("word"), "ts")
                .groupBy(_window(), "word").count())

    def composite():
        return (source().groupBy(_window(), "user", F.size("words").alias("n_words"))
                .agg(F.sum("len").alias("s"), F.avg("len").alias("a"), F.max("len").alias("m")))

    def fallback():  # (percentile_approx: not an engine aggregate, so Spark runs it)
        return (source().groupBy(_window(), "user")
                .agg(F.percentile_approx("len", 0.5).alias("p"), F.sum("len").alias("s")))

    def run(make, name, i):
        out = work / f"{name}-{i}"
        spark.sparkContext._jvm.System.gc()  # (untimed: the last run's garbage is not this one's)
        t0 = time.perf_counter()  # (from the DataFrame's making: stretch(df) analyses the plan)
        df = make()
        q = (df.writeStream.format("delta").option("checkpointLocation", f"{out}-ckpt")
             .trigger(availableNow=True).start(str(out)))
        q.awaitTermination()
        if q.exception():
            raise RuntimeError(q.exception())
        took = time.perf_counter() - t0
        # Every run starts the engine process: the last run's is gone
        HostEngine.wait_stopped(30)
        return took, out

    def same(a, b):
        x, y = spark.read.format("delta").load(str(a)), spark.read.format("delta").load(str(b))
        return x.count() == y.count() and x.exceptAll(y).isEmpty() and y.exceptAll(x).isEmpty()

    variants = {
        "wordcount": {
            "native": wordcount,
            "stretch(df)": lambda: spark_stretch.stretch(wordcount(), max_parallelism=2,
                                                         parallelism=2),
            "stretchAggregate": lambda: source().stretchAggregate(
                keys="words", window=("120 seconds", "60 seconds"), agg="count",
                parallelism=2, max_parallelism=2),
        },
        "composite": {
            "native": composite,
            "stretch(df)": lambda: spark_stretch.stretch(composite(), max_parallelism=2,
                                                         parallelism=2),
        },
        "fallback": {
            "native": fallback,
            "stretch(df)": lambda: _quiet(lambda: spark_stretch.stretch(
                fallback(), max_parallelism=2, parallelism=2)),
        },
    }
    ok = True
    for query in args.queries.split(","):
        kinds = variants[query]
        times = {k: [] for k in kinds}
        outs = {}
        for k, make in kinds.items():  # an untimed warm-up of each (JIT, class loading)
            run(make, f"{query}-{k}-warmup", 0)
        names = list(kinds)
        for i in range(args.repeat):
            # Each round starts with the next kind: no kind always runs right after
            # another's (native's long runs leave the JVM garbage the next run collects)
            for k in names[i % len(names):] + names[:i % len(names)]:
                s, outs[k] = run(kinds[k], f"{query}-{k}".replace("(", "").replace(")", ""),
                                 i)
                times[k].append(s)
        # stretchAggregate's columns are window, key, count: compare it renamed
        equal = {}
        for k, out in outs.items():
            if k == "stretchAggregate":
                a = spark.read.format("delta").load(str(out)).toDF("window", "word", "count")
                b = spark.read.format("delta").load(str(outs["native"]))
                equal[k] = a.exceptAll(b).isEmpty() and b.exceptAll(a).isEmpty()
            else:
                equal[k] = same(out, outs["native"])
        ok = ok and all(equal.values())
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in kinds:
            print(f"{query:<10} {k:<17} {med[k]:6.2f} s  {args.tweets / med[k]:>10,.0f} "
                  f"tweets/s  {med['native'] / med[k]:5.2f}x native  equal={equal[k]}  "
                  f"runs={[round(t, 2) for t in times[k]]}", flush=True)
    if not ok:
        sys.exit("outputs differ from native Spark's")


if __name__ == "__main__":
    main()
