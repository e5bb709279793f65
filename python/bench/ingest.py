"""How a micro-batch reaches the engine: the three ingest paths side by side, in one run.

    python python/bench/ingest.py [--tweets 1000000] [--files 10] [--repeat 3]
                                  [--variant NAME:KEY=VALUE[,KEY=VALUE]]... [--json]

The word count of ``python/bench/spark.py`` (parquet tweet stream, ``--files`` micro-batches,
availableNow, local[2], into Delta) with the batch going to the engine

- ``files``: the engine reads the batch's Parquet files itself (``spark.stretch.ingest.files``,
  the default for a plain Parquet scan);
- ``columnar``: the shim sends the scan's column vectors as Arrow (``ingest.files=false``);
- ``rows``: ``foreachBatch``'s rows through ``format("stretch")`` (``ingest.columnar=false``);

and the ingest floor (the same stream read and dropped by Spark). Each runs once untimed (JVM
warm-up), then ``--repeat`` times alternated; medians are reported, as input tweets per second,
with each path's ratio to the floor. The three tables are checked equal. Each ``--variant`` adds
the files path with other session settings (e.g. ``nice0:spark.stretch.engine.niceness=0``),
run alternated with the others: a setting's effect measured side by side.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys

from pyspark.sql import functions as F

import spark_stretch
from workdir import bench_run
from spark import WINDOW, _source, _timed  # python/bench/spark.py: the same stream and query
from spark_stretch.testing import write_tweets

PATHS = {"files": {}, "columnar": {"spark.stretch.ingest.files": "false"},
         "rows": {"spark.stretch.ingest.columnar": "false"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tweets", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:KEY=VALUE[,KEY=VALUE]: the files path with these settings")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    paths = {n: (n, conf) for n, conf in PATHS.items()}  # name -> (ingest path, settings)
    for v in args.variant:
        name, _, settings = v.partition(":")
        paths[name] = ("files", dict(kv.split("=", 1) for kv in settings.split(",")))
    with bench_run("stretch-bench-ingest-") as bench:
        _main(args, paths, bench)


def _main(args, paths, bench) -> None:
    work = bench.path
    src = write_tweets(work / "tweets", args.tweets, files=args.files, rate=1000.0, seed=1)
    spark = bench.session(spark_stretch.session(app_name="bench ingest",
                                                conf={"spark.sql.shuffle.partitions": "2"}))
    spark.sparkContext.setLogLevel("ERROR")

    def run(name: str) -> float:
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(str(out) + "-ckpt", ignore_errors=True)
        path, conf = paths.get(name, ("floor", {}))
        for k, v in conf.items():
            spark.conf.set(k, v)
        try:
            if name == "floor":
                w = _source(spark, src).writeStream.format("noop")
            else:
                w = _source(spark, src).stretchAggregate(
                    keys=F.col("words"), window=WINDOW, agg="count",
                    parallelism=2, max_parallelism=2).writeStream.format("delta")
            queries = []

            def start():
                queries.append(w.option("checkpointLocation", str(out) + "-ckpt")
                               .trigger(availableNow=True)
                               .start(None if name == "floor" else str(out)))
                return queries[-1]
            took = _timed(start)
            if name != "floor":  # (each batch went the path named)
                assert queries[0].metrics()["ingest"] == {path: args.files}, \
                    queries[0].metrics()["ingest"]
            return took
        finally:
            for k in conf:
                spark.conf.unset(k)

    names = ["floor", *paths]
    times = {n: [] for n in names}
    for n in names:
        run(n)  # untimed warm-up
    for _ in range(args.repeat):
        for n in names:
            times[n].append(run(n))
    tables = [spark.read.format("delta").load(str(work / n)) for n in paths]
    equal = all(t.count() == tables[0].count() and t.exceptAll(tables[0]).isEmpty()
                and tables[0].exceptAll(t).isEmpty() for t in tables[1:])
    tps = {n: args.tweets / statistics.median(v) for n, v in times.items()}
    report = {"tweets": args.tweets, "files": args.files, "tps": tps, "equal": bool(equal),
              "runs_s": times}
    if args.json:
        print(json.dumps(report))
    else:
        for n in names:
            print(f"{n:<9} {tps[n]:>10,.0f} tweets/s   / floor {tps[n] / tps['floor']:5.2f}   "
                  f"runs {[round(x, 2) for x in times[n]]}")
        print(f"equal={equal}")
    if not equal:
        sys.exit("the ingest paths gave different tables")


if __name__ == "__main__":
    main()
