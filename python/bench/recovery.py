"""Recovery time: restart a query from its checkpoint, native Spark vs stretchAggregate.

    python python/bench/recovery.py [--tweets 100000] [--files 4] [--json]

Both queries (pair count within distance 3, one-hour windows, so the state only grows: about a
million live windows at the default size) first run ``availableNow`` over all files but one, into
Delta, each with its own checkpoint. Then one more file arrives and each query is started again
from its checkpoint; the restart is timed from ``start()`` until that run (the new file's batch,
whose state must be restored first, and Spark's no-data batch) has ended. A last file two hours
later then closes every window, and the two tables are compared. Native Spark restores
its HDFS-backed state store from the checkpoint's delta/snapshot files; stretch restores the host
engine from the checkpoint of the last committed batch. Outputs are checked equal.

Fair set-up for native Spark: local[2], spark.driver.memory=4g, spark.sql.shuffle.partitions=2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import spark_stretch
from spark_stretch.testing import publish, write_tweets
from workdir import bench_run

SCHEMA = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tweets", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with bench_run("stretch-bench-recovery-") as bench:
        work = bench.path
        files = sorted((write_tweets(work / "all", args.tweets, files=args.files, rate=50.0,
                                     seed=3)).glob("*.parquet"))
        # Two hours later: closes every window of the first hour (written after the timed restart,
        # so the outputs can be compared).
        closing = sorted(write_tweets(work / "late", 1000, rate=50.0, start_s=7200.0, seed=4,
                                      first_file=args.files).glob("*.parquet"))[0]
        src = work / "src"
        src.mkdir()
        for f in files[:-1]:
            publish(f, src)
        spark = bench.session(spark_stretch.session(app_name="bench recovery",
                                                    conf={"spark.sql.shuffle.partitions": "2"}))
        spark.sparkContext.setLogLevel("ERROR")

        def agg():
            return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
                    .withWatermark("ts", "10 seconds")
                    .stretchAggregate(keys=spark_stretch.pairs("words", distance=3),
                                      window="1 hour", parallelism=2, max_parallelism=2))

        def run(kind):
            a = agg()
            w = a.native().writeStream.outputMode("append") if kind == "native" else a.writeStream
            t0 = time.perf_counter()
            q = (w.format("delta").option("checkpointLocation", str(work / f"{kind}-ckpt"))
                 .trigger(availableNow=True).start(str(work / kind)))
            q.awaitTermination()
            return time.perf_counter() - t0, q

        report = {"tweets": args.tweets, "files": args.files}
        for kind in ("native", "stretch"):
            report[f"{kind}_first_run_s"], q = run(kind)
            if kind == "stretch":
                report["live_windows"] = q.metrics()["engine"]["live_windows"]
            else:
                report["native_state_rows"] = q.lastProgress["stateOperators"][0]["numRowsTotal"]
        publish(files[-1], src)  # one more file, then restart both
        for kind in ("native", "stretch"):
            report[f"{kind}_restart_s"], q = run(kind)
            if kind == "stretch":
                report["stretch_checkpoint"] = [b["checkpoint"] for b in q.metrics()["batch_times"]]
        publish(closing, src)
        report["native_closing_s"], _ = run("native")
        report["stretch_closing_s"], _ = run("stretch")
        a = spark.read.format("delta").load(str(work / "native"))
        b = spark.read.format("delta").load(str(work / "stretch"))
        report["equal"] = bool(a.count() == b.count() and a.exceptAll(b).isEmpty()
                               and b.exceptAll(a).isEmpty())
        report["rows"] = a.count()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"state: {report['live_windows']:,} live windows (native state store rows "
              f"{report['native_state_rows']:,})")
        print(f"restart from checkpoint + one batch: native {report['native_restart_s']:.1f} s, "
              f"stretch {report['stretch_restart_s']:.1f} s, native/stretch "
              f"{report['native_restart_s'] / report['stretch_restart_s']:.2f}x; "
              f"equal={report['equal']}")
    if not report["equal"]:
        sys.exit("outputs differ between native Spark and stretchAggregate")


if __name__ == "__main__":
    main()
