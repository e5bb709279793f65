"""An elastic query following a stepped input rate by itself (STRETCH's Q5, Fig. 11), plotted.

A live stream of keyed events is written into a local folder, one file a second, at a low rate,
then a high one, then low again. A sliding-window count per key with
``stretchAggregate(..., elastic=True)`` reads it into a local Delta table: the controller adds
an instance when the instances' utilization passes 90% and removes it when it falls below 45%
(an epoch switch between two batches: no restart, no state moved). At the end the figures are
saved (``metrics.json``) and plotted (``elastic.png``: input rate, parallelism and event-time
latency over time), and the reconfigurations are printed with their causes.

Run it::

    python examples/elastic_stepped_rate.py [--low 5000] [--high 150000] [--phase 20] [--out DIR]

On a busy or a slow machine, a lower ``--high`` still steps over the thresholds; on a fast one,
raise it (the high rate must keep one instance busy for more than 90% of each second).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import spark_stretch
from spark_stretch.plot import plot_metrics
from spark_stretch.testing.stepped import event_source, publish_steps, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--low", type=int, default=5_000, help="events a second, low steps")
    ap.add_argument("--high", type=int, default=150_000, help="events a second, the high step")
    ap.add_argument("--phase", type=int, default=20, help="seconds of each step")
    ap.add_argument("--out", help="working folder (default: a temporary one; the plot and the "
                                  "figures are copied to the current folder)")
    ap.add_argument("--verbose", action="store_true", help="Spark's start-up output")
    args = ap.parse_args()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="stretch-elastic-"))
    src, table, ckpt = work / "events", work / "counts", work / "checkpoint"
    sizes = steps(args.low, args.high, args.phase, args.phase, args.phase)

    src.mkdir(parents=True, exist_ok=True)
    spark = spark_stretch.session(app_name="spark-stretch elastic", verbose=args.verbose or None)
    try:
        counts = (event_source(spark, src, delay="2 seconds")
                  .stretchAggregate(keys="k", window=("10 seconds", "1 second"),
                                    max_parallelism=2, elastic=True))
        publisher = publish_steps(src, sizes, interval_s=1.0, keys=200_000)
        q = (counts.writeStream.format("delta").option("checkpointLocation", str(ckpt))
             .trigger(processingTime="1 second").start(str(table)))
        print(f"{len(sizes)} s of events: {args.low:,}/s, then {args.high:,}/s, then "
              f"{args.low:,}/s")
        shown = 0
        while publisher.is_alive() or shown < q.metrics()["batches"]:
            for r in q.metrics()["per_batch"][shown:]:
                p99 = r["latency_p99_ms"]
                print(f"batch {r['batch']:3d}  {r['input_rows']:>8,} rows  parallelism "
                      f"{r['parallelism']}  utilization {r['utilization_max']:5.2f}  "
                      f"p99 latency {'-' if p99 is None else f'{p99:,.0f} ms':>10}"
                      f"{'  <- ' + r['switched'] if r['switched'] else ''}")
                shown += 1
            if not publisher.is_alive():
                q.processAllAvailable()
            time.sleep(0.5)
        q.stop()
        m = q.metrics()
        (work / "metrics.json").write_text(json.dumps(m, default=str))
        plot_metrics(m, work / "elastic.png", title="stretchAggregate(elastic=True), stepped rate")
        for r in m["reconfigurations"]:
            print(f"after batch {r['after_batch']}: {r['cause']} to parallelism "
                  f"{r['parallelism']}, epoch switch {r['switch_ms']:.2f} ms "
                  f"({r['live_windows']:,} live windows, no state moved)")
        keep = Path.cwd() if not args.out else work
        if not args.out:
            for f in ("elastic.png", "metrics.json"):
                shutil.copy(work / f, keep / f)
        print(f"plot: {keep / 'elastic.png'}  figures: {keep / 'metrics.json'}")
    finally:
        spark.stop()
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
