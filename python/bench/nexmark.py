"""Nexmark on Spark Structured Streaming: each query Spark can express, written as a Spark user
writes it, run natively and through ``stretch(df)`` side by side, into Delta.

    python python/bench/nexmark.py [--events 1000000] [--files 10] [--queries q5,q7,...]
                                   [--source files|kafka] [--rocksdb] [--json out.json]

The events (:mod:`nexmark_gen`: persons, auctions and bids, 1 : 3 : 46, 10,000 events/s of event
time, up to 3 s out of order) are written once as Parquet, ``--files`` files per kind, and read
as streams, one file a micro-batch (``maxFilesPerTrigger=1``, availableNow), with a watermark of
4 s on ``dateTime``; or, with ``--source kafka``, as JSON records on the topics of a Kafka broker
started here (``KafkaBroker``, 2 partitions a topic), ``--files`` micro-batches
(``maxOffsetsPerTrigger``) parsed with ``from_json``. local[2],
``spark.sql.shuffle.partitions=2``, driver memory 4g; native Spark's state store is its default
one (``--rocksdb``: RocksDB).

For every query: native time, ``stretch(df)`` time, their ratio, events/s (all Nexmark events up
to the last one the query reads, as Nexmark counts them) and per core (2), whether the tables are
equal (exceptAll both ways), and, when ``stretch(df)`` ran it natively, the reason (its
``FallbackWarning``). ``floor``: the bids read and dropped (``noop`` sink), the same trigger: what
Spark needs just to read the stream. Queries Spark cannot express are listed with the reason.

Nexmark's queries are written after the Flink/Beam definitions; where Spark needs another form
the docstring says so (e.g. a 10-second window where Flink's q15-q17 group by day, whose windows
would not close within a run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import functions as F  # noqa: E402

import nexmark_gen as gen  # noqa: E402
import spark_stretch  # noqa: E402
from spark_stretch.driver.engine import HostEngine  # noqa: E402
from spark_stretch.testing.kafka import SPARK_KAFKA_PACKAGE, KafkaBroker  # noqa: E402
from workdir import bench_run  # noqa: E402

WATERMARK = "4 seconds"
CORES = 2

# Queries Spark Structured Streaming cannot express, and why.
NOT_EXPRESSIBLE = {
    "q4": "the average of each category's closing prices: an aggregation over the join's "
          "per-auction maxima, non-windowed (append mode needs event-time windows)",
    "q6": "the average of each seller's last 10 closing prices: a row-count window (OVER), "
          "which streaming does not support",
    "q9": "winning bids: a top-1 per auction over a join (ROW_NUMBER), not supported on streams",
    "q12": "processing-time windows: Spark windows on event time only",
    "q18": "the last bid per bidder and auction (ROW_NUMBER): not supported on streams",
    "q19": "top 10 bids per auction (ROW_NUMBER): not supported on streams",
}


#: The session's settings, for native Spark and ``stretch(df)`` alike.
CONF = {"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g",
        "spark.sql.session.timeZone": "UTC"}


def from_files(spark, events: Path, kind: str, schema):
    """The Parquet files of ``kind`` under ``events`` as a stream, one file a micro-batch, with
    the watermark."""
    return (spark.readStream.option("maxFilesPerTrigger", 1).schema(schema)
            .parquet(str(events / kind)).withWatermark("dateTime", WATERMARK))


def same_tables(spark, a: Path, b: Path) -> tuple:
    """Whether the Delta tables at ``a`` and ``b`` hold the same rows (exceptAll both ways), and
    ``b``'s row count."""
    x, y = spark.read.format("delta").load(str(a)), spark.read.format("delta").load(str(b))
    return x.exceptAll(y).isEmpty() and y.exceptAll(x).isEmpty(), y.count()


def on_engine(df):
    """``df`` through ``stretch(df)`` on this machine's 2 cores."""
    return spark_stretch.stretch(df, parallelism=2, max_parallelism=2)


def from_kafka(spark, bootstrap: str, topic: str, schema, max_offsets: int = 0):
    """``topic``'s JSON records as a stream of ``schema``'s columns, from the earliest offset
    (``max_offsets``: Spark's ``maxOffsetsPerTrigger``, 0: no limit), with the watermark."""
    r = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
         .option("subscribe", topic).option("startingOffsets", "earliest"))
    if max_offsets:
        r = r.option("maxOffsetsPerTrigger", max_offsets)
    return (r.load().select(F.from_json(F.col("value").cast("string"), schema).alias("e"))
            .select("e.*").withWatermark("dateTime", WATERMARK))


def queries(bid, auction, person, wrap=lambda df: df):
    """The queries, each a function of nothing returning the streaming DataFrame (read anew),
    the inner stage of a chained aggregation passed through ``wrap`` (``stretch`` for the
    stretch runs, which also wrap the query itself: each stage wrapped, as a user writes it)."""
    def q0():  # pass-through
        return bid().select("auction", "bidder", "price", "dateTime", "extra")

    def q1():  # currency conversion
        return bid().select("auction", "bidder", (F.col("price") * 0.908).alias("price"),
                            "dateTime", "extra")

    def q2():  # selection
        return bid().where(F.col("auction") % 123 == 0).select("auction", "price")

    def q3():  # local item suggestion: an unbounded stream-stream join
        a = auction().where("category = 10").alias("a")
        p = person().where(F.col("state").isin("OR", "ID", "CA")).alias("p")
        return a.join(p, F.expr("a.seller = p.id")).select("p.name", "p.city", "p.state",
                                                           F.col("a.id").alias("id"))

    def q5():  # hot items, first stage: bids per auction per hop window (10 s, every 2 s)
        return (bid().groupBy(F.window("dateTime", "10 seconds", "2 seconds"), "auction")
                .agg(F.count("*").alias("num")))

    def q5max():  # hot items, second stage: the top count per window (chained aggregation)
        return (wrap(q5()).groupBy(F.window(F.window_time("window"), "2 seconds"))
                .agg(F.max("num").alias("maxn")))

    def q7():  # highest bid, as Spark writes it: the max price per 10 s tumble window
        return bid().groupBy(F.window("dateTime", "10 seconds")).agg(
            F.max("price").alias("maxprice"))

    def q8():  # new users: persons who opened an auction in the same 10 s window
        p = person().select(F.col("id"), "name", F.window("dateTime", "10 seconds").alias("w"))
        a = auction().select(F.col("seller"), F.window("dateTime", "10 seconds").alias("aw"))
        return p.join(a, F.expr("id = seller AND w = aw")).select("id", "name", "w")

    def q11():  # user sessions: bids per bidder per session (gap 10 s)
        return (bid().groupBy(F.session_window("dateTime", "10 seconds"), "bidder")
                .agg(F.count("*").alias("bid_count")))

    def q15():  # bidding statistics (Flink: per day, with distinct counts; here 10 s windows,
        # no distinct: streams do not support distinct aggregates)
        p = F.col("price")
        return bid().groupBy(F.window("dateTime", "10 seconds")).agg(
            F.count("*").alias("total_bids"), F.count_if(p < 10_000).alias("rank1_bids"),
            F.count_if((p >= 10_000) & (p < 1_000_000)).alias("rank2_bids"),
            F.count_if(p >= 1_000_000).alias("rank3_bids"))

    def q16():  # channel statistics (as q15, per channel)
        p = F.col("price")
        return bid().groupBy(F.window("dateTime", "10 seconds"), "channel").agg(
            F.count("*").alias("total_bids"), F.count_if(p < 10_000).alias("rank1_bids"),
            F.count_if(p >= 1_000_000).alias("rank3_bids"), F.max("price").alias("max_price"))

    def q17():  # auction statistics (Flink: per day; here 10 s windows)
        p = F.col("price")
        return bid().groupBy(F.window("dateTime", "10 seconds"), "auction").agg(
            F.count("*").alias("total_bids"), F.count_if(p < 10_000).alias("rank1_bids"),
            F.count_if((p >= 10_000) & (p < 1_000_000)).alias("rank2_bids"),
            F.count_if(p >= 1_000_000).alias("rank3_bids"), F.min("price").alias("min_price"),
            F.max("price").alias("max_price"), F.avg("price").alias("avg_price"),
            F.sum("price").alias("sum_price"))

    def q20():  # expand bids with their auction (category 10): a stream-stream join
        a = auction().where("category = 10").select(F.col("id"), "itemName", "seller")
        return bid().join(a, F.expr("auction = id")).select("auction", "bidder", "price",
                                                             "itemName", "seller")

    def q21():  # add a channel id (stateless)
        return bid().select("auction", "bidder", "price", "channel", F.when(
            F.lower("channel") == "apple", "0").when(F.lower("channel") == "google", "1")
            .otherwise(F.regexp_extract("url", r"channel_id=([^&]*)", 1)).alias("channel_id"))

    return {f.__name__: f for f in (q0, q1, q2, q3, q5, q5max, q7, q8, q11, q15, q16, q17, q20,
                                    q21)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--queries", default="")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rocksdb", action="store_true")
    ap.add_argument("--source", choices=("files", "kafka"), default="files",
                    help="Parquet files, or a Kafka broker started here (KafkaBroker)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        bench = stack.enter_context(bench_run("stretch-bench-nexmark-"))
        work = bench.path
        broker = None
        t = time.perf_counter()
        if args.source == "kafka":
            broker = stack.enter_context(KafkaBroker())
            counts = gen.to_kafka(broker, args.events, args.files, seed=1)
        else:
            gen.write(work / "events", args.events, args.files, seed=1)
            counts = {}
        print(f"generated {args.events:,} events into {args.source} in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        _bench(args, bench, broker, counts)


def _bench(args, bench, broker, counts) -> None:
    work = bench.path
    conf = dict(CONF)
    if broker is not None:
        conf["spark.jars.packages"] = SPARK_KAFKA_PACKAGE
    if args.rocksdb:
        conf["spark.sql.streaming.stateStore.providerClass"] = (
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    spark = bench.session(spark_stretch.session(app_name="bench nexmark", conf=conf))
    spark.sparkContext.setLogLevel("ERROR")

    def reader(kind, schema):
        def read():
            if broker is not None:
                return from_kafka(spark, broker.bootstrap, kind, schema,
                                  -(-counts[kind] // args.files))
            return from_files(spark, work / "events", kind, schema)
        return read

    sources = (reader("bid", gen.BID_SCHEMA), reader("auction", gen.AUCTION_SCHEMA),
               reader("person", gen.PERSON_SCHEMA))
    qs = queries(*sources)
    stretched = queries(*sources, wrap=on_engine)
    chosen = args.queries.split(",") if args.queries else list(qs)

    def run(make, out, sink="delta"):
        spark.sparkContext._jvm.System.gc()  # (untimed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", spark_stretch.FallbackWarning)
            t0 = time.perf_counter()
            df = make()
            w = df.writeStream.format(sink).option("checkpointLocation", f"{out}-ckpt")
            q = w.trigger(availableNow=True).start(*([] if sink == "noop" else [str(out)]))
            q.awaitTermination()
            took = time.perf_counter() - t0
        if q.exception():
            raise RuntimeError(q.exception())
        HostEngine.wait_stopped(30)  # (the next run starts its own engine)
        reasons = [str(c.message) for c in caught
                   if issubclass(c.category, spark_stretch.FallbackWarning)]
        return took, reasons

    results = []
    ok = True
    try:
        # Untimed warm-ups (the JVM's JIT, the engine's compiled kernels): one aggregation each
        # way, then the floor's first run.
        run(qs["q17"], work / "warm-native")
        run(lambda: on_engine(qs["q17"]()), work / "warm-stretch")
        floor = [run(qs["q0"], work / f"floor-{i}", sink="noop")[0]
                 for i in range(args.repeat + 1)][1:]  # (the first: warm-up)
        fl = statistics.median(floor)
        results.append({"query": "floor", "native_s": fl})
        print(f"floor (bids read, noop sink): {statistics.median(floor):.2f} s, "
              f"{args.events / statistics.median(floor):,.0f} events/s", flush=True)
        for name in chosen:
            times = {"native": [], "stretch": []}
            reasons = []
            for i in range(args.repeat):
                order = ("native", "stretch") if i % 2 == 0 else ("stretch", "native")
                for kind in order:
                    make = qs[name] if kind == "native" else (
                        lambda m=stretched[name]: on_engine(m()))
                    took, why = run(make, work / f"{name}-{kind}-{i}")
                    times[kind].append(took)
                    reasons = reasons or why
            equal, rows = same_tables(spark, work / f"{name}-stretch-0", work / f"{name}-native-0")
            ok = ok and equal
            n, s = statistics.median(times["native"]), statistics.median(times["stretch"])
            row = {"query": name, "native_s": n, "stretch_s": s, "ratio": n / s,
                   "events_per_s": args.events / s, "per_core": args.events / s / CORES,
                   "native_events_per_s": args.events / n, "of_floor": fl / s,
                   "rows": rows, "equal": equal,
                   "fallback": "; ".join(sorted(set(reasons)))}
            results.append(row)
            print(f"{name:<6} native {n:6.2f} s  stretch {s:6.2f} s  {n / s:5.2f}x  "
                  f"{args.events / s:>9,.0f} ev/s ({args.events / s / CORES:>8,.0f}/core)  "
                  f"{fl / s:4.2f} of floor  rows={rows} equal={equal}"
                  + (f"  FALLBACK: {row['fallback']}" if reasons else ""), flush=True)
        for name, why in NOT_EXPRESSIBLE.items():
            print(f"{name:<6} not expressible in Structured Streaming: {why}")
    finally:  # (its queries first; before the broker stops)
        bench.stop_sessions()
    if args.json:
        Path(args.json).write_text(json.dumps({"events": args.events, "files": args.files,
                                               "source": args.source,
                                               "rocksdb": args.rocksdb, "results": results,
                                               "not_expressible": NOT_EXPRESSIBLE}, indent=1))
    if not ok:
        sys.exit("outputs differ from native Spark's")


if __name__ == "__main__":
    main()
