"""Band join of two streams: stretchAggregate(agg=band_join, others=...) vs Spark's stream-stream join.

    python python/bench/join.py [--points 200000] [--rate 200] [--files 10] [--json]

Two point streams (``ts, x, y`` and ``ts, a, b``, uniform in [0, 1000)^2, ``--rate`` points a
second of event time each, ``--files`` files = micro-batches, availableNow, local[2], 5 s
watermark delay) are joined on ``|x - a| <= 10 and |y - b| <= 10`` and event times less than 10 s
apart, into Delta:

- stretch: ScaleJoin on the VSN engine (16 shares, parallelism 2): every tuple is compared with
  every stored tuple of the other stream in its window (no index);
- native: Spark needs an equality predicate, so the fair baseline joins on grid cells of the
  band's size (each left row exploded to its 3 x 3 cells), a hash join after a shuffle
  (spark.sql.shuffle.partitions=2, one per core; spark.driver.memory=4g).

Outputs are checked equal (native's rows restricted to pairs whose later tuple the final
watermark passed: Spark emits on arrival, stretch when the watermark passes). Reported: input
points (both streams) per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pyspark.sql import functions as F

import spark_stretch
from workdir import bench_run
from spark_stretch.ops import band_join
from spark_stretch.testing import write_points


def _timed(start):
    t0 = time.perf_counter()
    q = start()
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(q.exception())
    return q, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=200_000, help="points per stream")
    ap.add_argument("--rate", type=float, default=200.0, help="points per second of event time")
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with bench_run("stretch-bench-join-") as bench:
        work = bench.path
        for name, cols, seed in (("l", ("x", "y"), 1), ("r", ("a", "b"), 2)):
            write_points(work / name, args.points, files=args.files, rate=args.rate, seed=seed,
                         columns=cols, span=1000.0, jitter_s=2.0)
        spark = bench.session(spark_stretch.session(app_name="bench join",
                                                    conf={"spark.sql.shuffle.partitions": "2"}))
        spark.sparkContext.setLogLevel("ERROR")

        def stream(name, cols):
            return (spark.readStream.schema(f"ts TIMESTAMP, {cols}")
                    .option("maxFilesPerTrigger", 1).parquet(str(work / name))
                    .withWatermark("ts", "5 seconds"))

        join = stream("l", "x DOUBLE, y DOUBLE").stretchAggregate(
            agg=band_join(WS=1, shares=16), window="10 seconds",
            others=stream("r", "a DOUBLE, b DOUBLE"),
            parallelism=args.parallelism, max_parallelism=args.parallelism)
        nq, native_s = _timed(lambda: join.native().writeStream.format("delta")
                              .option("checkpointLocation", str(work / "n-ckpt"))
                              .trigger(availableNow=True).start(str(work / "n")))
        sq, stretch_s = _timed(lambda: join.writeStream.format("delta")
                               .option("checkpointLocation", str(work / "s-ckpt"))
                               .trigger(availableNow=True).start(str(work / "s")))
        wm = sq.metrics()["engine"]["watermark_ms"]
        a = spark.read.format("delta").load(str(work / "n")).where(
            F.greatest("l_ts", "r_ts") <= F.timestamp_micros(F.lit(wm * 1000)))
        b = spark.read.format("delta").load(str(work / "s"))
        rows = b.count()
        equal = a.count() == rows and a.exceptAll(b).isEmpty() and b.exceptAll(a).isEmpty()
        n = 2 * args.points
        report = {"points_per_stream": args.points, "rate": args.rate, "files": args.files,
                  "native": n / native_s, "stretch": n / stretch_s, "rows": rows,
                  "equal": bool(equal)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"band join  native {report['native']:>10,.0f}  stretch {report['stretch']:>10,.0f} "
              f"points/s   stretch/native {report['stretch'] / report['native']:5.2f}x   "
              f"rows {rows:,}  equal={equal}")
    if not equal:
        sys.exit("outputs differ between native Spark and stretch")


if __name__ == "__main__":
    main()
