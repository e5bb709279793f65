"""Event-time latency from Kafka: native Spark against ``stretch(df)``, the same stream at the
same rate, one after the other.

    python python/bench/latency.py [--rate 35000] [--seconds 100] [--warmup 25]
                                   [--queries q5,q7] [--json out.json] [--plot out.png]

A Kafka broker starts here (:class:`spark_stretch.testing.kafka.KafkaBroker`). For each query
and side, a producer thread writes Nexmark's bids (:mod:`nexmark_gen`, ``--rate`` Nexmark
events per second of which 46/50 are bids, 10% up to 3 s out of order) as JSON to a new topic
in real time: the events of each 100 ms are written when the wall clock reaches their end, an
event's ``dateTime`` being its place in the stream after a start aligned to 10 s. The query
(Nexmark's q5 or q7 as :mod:`nexmark` writes it, watermark 4 s, append mode, Spark's default
trigger: a batch as soon as the last one ends) reads the topic and writes each closed window's
rows as JSON to an output topic whose record times are the broker's append times
(``LogAppendTime``). A row's latency is that time minus its window's end: what a user waits
for a window after it ended, the 4 s of watermark delay included (the same on both sides).

Reported per query and side: p50, p99 and max latency over the rows of the windows that end
after ``--warmup`` s (the engine's start and the JIT are not what a running query sees), the
median batch time, and whether both sides' rows are equal (windows by their place in the run;
the same events in the same windows). ``--rate`` should be about half of what native Spark
sustains on this source (``nexmark.py --source kafka``): both sides then keep up.
local[2], ``spark.sql.shuffle.partitions=2``, driver memory 4g.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

import nexmark  # noqa: E402
import nexmark_gen as gen  # noqa: E402
import spark_stretch  # noqa: E402
from spark_stretch.driver.engine import HostEngine  # noqa: E402
from spark_stretch.testing.kafka import SPARK_KAFKA_PACKAGE, KafkaBroker, send  # noqa: E402
from workdir import bench_run  # noqa: E402

TICK_S = 0.1
ALIGN_S = 10


class Producer(threading.Thread):
    """Writes the bids of ``rate`` Nexmark events/s to ``topic`` in real time from ``start``
    (epoch seconds) for ``seconds``; ``behind`` is the most it fell behind the clock (s)."""

    def __init__(self, broker: KafkaBroker, topic: str, rate: int, start: float, seconds: int,
                 seed: int = 1):
        super().__init__(daemon=True)
        from confluent_kafka import Producer as KafkaProducer

        self.topic, self.rate, self.t0, self.seconds, self.seed = (topic, rate, start,
                                                                   seconds, seed)
        self.producer = KafkaProducer({"bootstrap.servers": broker.bootstrap, "linger.ms": 5,
                                       "log_level": 3, "enable.idempotence": True})
        self.behind = 0.0
        self.sent = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def _second(self, s: int):
        """Second ``s``'s bids as JSON lines, in 1 / TICK_S consecutive slices."""
        ev = gen.generate(self.rate, first=s * self.rate, rate=self.rate, seed=self.seed,
                          start=datetime.datetime.fromtimestamp(self.t0,
                                                                datetime.timezone.utc)
                          .replace(tzinfo=None))["bid"]
        lines = gen.json_lines(ev)
        per = int(round(1 / TICK_S))
        bounds = np.linspace(0, len(lines), per + 1).astype(int)
        return [lines[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def run(self) -> None:
        try:
            nxt = self._second(0)
            for s in range(self.seconds):
                ticks, nxt = nxt, None
                for j, tick in enumerate(ticks):
                    due = self.t0 + s + (j + 1) * TICK_S
                    wait = due - time.time()
                    if wait > 0:
                        time.sleep(wait)
                    else:
                        self.behind = max(self.behind, -wait)
                    for value in tick:
                        send(self.producer, self.topic, value)
                    self.sent += len(tick)
                    self.producer.poll(0)
                    if nxt is None and s + 1 < self.seconds:
                        nxt = self._second(s + 1)  # (generated during the first tick's slack)
                    if self._halt.is_set():
                        return
            if self.producer.flush(60):
                raise RuntimeError(f"bids left unwritten on {self.topic!r}")
        except BaseException as e:  # (reported by the main thread)
            self.error = e

    def stop(self) -> None:
        self._halt.set()


def run_one(spark, broker: KafkaBroker, work: Path, name: str, side: str, args) -> dict:
    """One query on one side: its output rows, latencies and batch times."""
    src, out = f"bid-{name}-{side}", f"out-{name}-{side}"
    broker.create_topic(src, 2)
    broker.create_topic(out, 1, {"message.timestamp.type": "LogAppendTime"})

    def bid():
        return nexmark.from_kafka(spark, broker.bootstrap, src, gen.BID_SCHEMA)

    stretched = side == "stretch"
    qs = nexmark.queries(bid, None, None, **({"wrap": nexmark.on_engine} if stretched else {}))
    df = nexmark.on_engine(qs[name]()) if stretched else qs[name]()
    cols = [c for c in df.columns if c != "window"]
    df = df.select(F.to_json(F.struct(F.unix_micros(F.col("window.end")).alias("end"),
                                      *cols)).alias("value"))
    q = (df.writeStream.format("kafka").option("kafka.bootstrap.servers", broker.bootstrap)
         .option("topic", out).option("checkpointLocation", str(work / f"{name}-{side}-ckpt"))
         .start())
    # The stream starts at the next 10 s after the query (and its engine) started.
    start = float((int(time.time()) // ALIGN_S + 2) * ALIGN_S)
    producer = Producer(broker, src, args.rate, start, args.seconds)
    try:
        producer.start()
        while producer.is_alive():
            producer.join(1.0)
            if q.exception() is not None:
                raise RuntimeError(f"{name} {side}: {q.exception()}")
        if producer.error is not None:
            raise RuntimeError(f"{name} {side}: the producer failed") from producer.error
        time.sleep(10)  # (the last closed windows written)
    finally:
        producer.stop()
        q.stop()
    progress = q.recentProgress
    HostEngine.wait_stopped(30)  # (the next run starts its own engine)
    rows, lat, windows = [], [], set()
    for ts_ms, value in broker.records(out):
        r = json.loads(value)
        rel = (r["end"] / 1e6) - start
        rows.append((round(rel, 3),) + tuple(sorted((k, v) for k, v in r.items() if k != "end")))
        if rel >= args.warmup:
            lat.append(ts_ms / 1e3 - r["end"] / 1e6)
            windows.add(r["end"])
    batches = [p["durationMs"].get("triggerExecution", 0) / 1e3 for p in progress
               if p["numInputRows"] > 0 and p["batchId"] > 0]
    return {"rows": rows, "latency": lat, "windows": len(windows), "batch_s": batches,
            "behind_s": producer.behind, "sent": producer.sent}


def pct(xs, p):
    return float(np.percentile(xs, p)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=35_000, help="Nexmark events per second")
    ap.add_argument("--seconds", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--queries", default="q5,q7")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    results, ok = {}, True
    with contextlib.ExitStack() as stack:
        bench = stack.enter_context(bench_run("stretch-bench-latency-"))
        work = bench.path
        broker = stack.enter_context(KafkaBroker())
        spark = spark_stretch.session(app_name="bench latency", conf={
            "spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g",
            "spark.sql.session.timeZone": "UTC", "spark.jars.packages": SPARK_KAFKA_PACKAGE,
            "spark.sql.streaming.numRecentProgressUpdates": "100000"})
        bench.session(spark)
        stack.callback(bench.stop_sessions)  # (its queries, then Spark; before the broker's end)
        spark.sparkContext.setLogLevel("ERROR")
        for name in args.queries.split(","):
            res = {side: run_one(spark, broker, work, name, side, args)
                   for side in ("native", "stretch")}
            # The same events in the same windows: the rows of the windows both wrote.
            common = ({r[0] for r in res["native"]["rows"]}
                      & {r[0] for r in res["stretch"]["rows"]})
            same = (sorted(r for r in res["native"]["rows"] if r[0] in common)
                    == sorted(r for r in res["stretch"]["rows"] if r[0] in common))
            ok = ok and same and bool(common)
            results[name] = {"equal": same, "windows": len(common)}
            for side, r in res.items():
                lat = r["latency"]
                row = {"p50_s": pct(lat, 50), "p99_s": pct(lat, 99),
                       "max_s": max(lat, default=float("nan")), "rows": len(lat),
                       "windows": r["windows"],
                       "batch_median_s": statistics.median(r["batch_s"] or [float("nan")]),
                       "batches": len(r["batch_s"]), "producer_behind_s": r["behind_s"],
                       "bids": r["sent"], "latency": lat}
                results[name][side] = row
                print(f"{name:<4} {side:<8} p50 {row['p50_s']:5.2f} s  p99 {row['p99_s']:5.2f} s"
                      f"  max {row['max_s']:5.2f} s  over {row['rows']:>7} rows of {row['windows']} "
                      f"windows;  batch median "
                      f"{row['batch_median_s']:5.2f} s ({row['batches']} batches);  producer "
                      f"behind at most {r['behind_s']:.2f} s", flush=True)
            print(f"{name:<4} equal={same} over {len(common)} windows", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": args.rate, "seconds": args.seconds,
                                               "warmup": args.warmup, "results": results}))
    if args.plot:
        plot(results, args, Path(args.plot))
    if not ok:
        sys.exit("outputs differ from native Spark's")


def plot(results: dict, args, path: Path) -> None:
    """Each query's latency distribution (CDF), native against stretch(df), p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        for side, color in (("native", "tab:gray"), ("stretch", "tab:blue")):
            lat = np.sort(res[side]["latency"])
            label = "native Spark" if side == "native" else "stretch(df)"
            ax.plot(lat, np.arange(1, len(lat) + 1) / max(len(lat), 1), color=color,
                    label=f"{label}: p99 {res[side]['p99_s']:.2f} s")
            ax.axvline(res[side]["p99_s"], color=color, linestyle=":")
        ax.set_title(f"Nexmark {name} from Kafka, {args.rate:,} events/s")
        ax.set_xlabel("output time - window end (s)")
        ax.set_ylabel("fraction of output rows")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
