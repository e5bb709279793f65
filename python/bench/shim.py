"""Shim throughput: the same rows out of executor JVMs to Python, through ``format("stretch")``
and through ``mapInArrow``, side by side in one run. Outputs are checked equal.

    python python/bench/shim.py [--rows N] [--repeat K] [--json]

Both paths move Arrow batches JVM -> Python on the same local[2] session; ``mapInArrow`` consumes
them in the Python workers (sum of ``id`` per batch), the stretch path in the host receiver (the
same sum over the committed table). Reported: rows/s (best of K) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

import spark_stretch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    spark = spark_stretch.session(app_name="bench shim")
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.range(0, args.rows, 1, 2).select(
        "id", F.expr("cast(id % 1000 as string)").alias("word"),
        F.expr("timestamp_micros(id)").alias("ts")).cache()
    df.count()  # both paths read the same cached input

    def via_map_in_arrow():
        def consume(batches):
            total, rows = 0, 0
            for b in batches:
                total += pc.sum(b.column(0)).as_py() or 0
                rows += b.num_rows
            yield pa.RecordBatch.from_pydict({"rows": [rows], "total": [total]})
        out = df.mapInArrow(consume, "rows long, total long").collect()
        return sum(r.rows for r in out), sum(r.total for r in out)

    def via_stretch(receiver):
        df.write.format("stretch").mode("append").options(**receiver.options("in")).save()
        t = receiver.take("in")
        return t.num_rows, pc.sum(t.column(0)).as_py()

    results = {"mapInArrow": [], "stretch": []}
    outs = {}
    with spark_stretch.Receiver() as receiver:
        for _ in range(args.repeat):
            for name, fn in (("mapInArrow", via_map_in_arrow),
                             ("stretch", lambda: via_stretch(receiver))):
                t0 = time.perf_counter()
                outs[name] = fn()
                results[name].append(time.perf_counter() - t0)
    spark.stop()

    expected = (args.rows, args.rows * (args.rows - 1) // 2)
    equal = outs["mapInArrow"] == outs["stretch"] == expected
    tps = {k: args.rows / min(v) for k, v in results.items()}
    report = {"rows": args.rows, "rows_per_s": tps, "ratio_stretch_over_mapInArrow":
              tps["stretch"] / tps["mapInArrow"], "equal": equal}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"rows: {args.rows:,} (id long, word string, ts timestamp), local[2], best of {args.repeat}")
        for k, v in tps.items():
            print(f"  {k:<12} {v/1e6:8.2f} M rows/s")
        print(f"  ratio stretch / mapInArrow: {report['ratio_stretch_over_mapInArrow']:.2f}   outputs equal: {equal}")
    if not equal:
        raise SystemExit(f"outputs differ: {outs} expected {expected}")


if __name__ == "__main__":
    main()
