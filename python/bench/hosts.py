"""One host x 2 cores against two hosts x 1 core, on a real standalone cluster on this machine.

    python python/bench/hosts.py [--tweets 1000000] [--files 10] [--queries wordcount,paircount-H]
                                 [--events 1000000] [--users 100000]
                                 [--bytes-tweets 100000] [--move-windows 10000,1000000]
                                 [--skew-events 2000000] [--json]

Workers bound to 127.0.0.2 (and 127.0.0.3) of this machine (``spark_stretch.testing.cluster``),
the driver on 127.0.0.1; the same 2 cores in both layouts, executors of 1 GB. Each layout runs in
its own driver process (``--layout``):

- **throughput**: ``stretchAggregate`` word count and pair count (the tweet stream of
  ``spark.py``: ``--files`` files = micro-batches, availableNow, windows of 120 s every 60 s, into
  Delta): one host with 2 instances, two hosts with 1 each (the engine of each host reading the
  batch's files and keeping its key groups). Every table is checked equal to the one-host
  layout's (``exceptAll`` both ways), and the word count also to native Spark's.
- **the drop-in** (``--queries sessions``): ``applyInPandasWithState``'s drop-in
  (``grouped.py``'s sessionization per user, ``--events`` events over ``--users`` users in
  ``--files`` files, into Delta in update mode): one host with 2 instances, two hosts with 1
  each (Spark routing each row to the host of its user's key group); the tables checked equal.
- **bytes between hosts** (``--bytes-tweets``, two hosts): the same queries with the rows path
  (each row routed by Spark to the hosts of its keys): the Arrow bytes the engines received over
  TCP from the other host, per input tweet; against native Spark's shuffle bytes (its stages'
  shuffle writes, from Spark's REST API) for the same query on the same input. Tables equal.
- **key-group move** (``--move-windows``, two hosts): a query holding about N live windows
  (N users, one window each); ``reconfigure(key_groups=...)`` moves every group to one host; its
  time. Against Spark 4.2's route for the same state: stop the native query (RocksDB state
  store), ``spark._streamingCheckpointManager.repartition(checkpoint, 1)``, restart.
- **elastic hosts** (``--skew-events``, two hosts): a count per key of Zipf-skewed keys (s = 1.1)
  whose 32 heaviest keys lie in the key groups the first host starts with (``--files``
  micro-batches, availableNow): the static host map against ``elastic=ElasticPolicy()`` (which
  moves key groups off the hot host); each run twice, alternated, after an untimed run; the
  host imbalance per batch and the moves reported, the tables equal (and to native Spark's).

``--queries ''`` runs no throughput query (nor the one-host layout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from workdir import bench_run

LAYOUTS = {"1x2": (("127.0.0.2",), 2), "2x1": (("127.0.0.2", "127.0.0.3"), 1)}
SCHEMA = "ts TIMESTAMP, words ARRAY<STRING>, user STRING, len BIGINT"
WINDOW = ("120 seconds", "60 seconds")


def _session(layout: str, url: str, ui: bool = False):
    import spark_stretch
    from spark_stretch.driver import jvm

    hosts, cores = LAYOUTS[layout]
    conf = {"spark.driver.memory": "2g", "spark.executor.memory": "1g",
            "spark.executor.cores": str(cores), "spark.cores.max": str(len(hosts) * cores),
            "spark.sql.shuffle.partitions": "2", "spark.stretch.keyGroups": "64",
            "spark.sql.files.openCostInBytes": str(1 << 30)}
    if ui:
        conf.update({"spark.ui.enabled": "true", "spark.ui.port": "0"})
    spark = spark_stretch.session(master=url, app_name=f"bench hosts {layout}", conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    deadline = time.time() + 120
    while len(jvm.executor_hosts(spark, driver=False)) < len(hosts) and time.time() < deadline:
        time.sleep(0.3)
    return spark


def _source(spark, src, per_batch=1):
    return (spark.readStream.option("maxFilesPerTrigger", per_batch).schema(SCHEMA)
            .parquet(str(src)).withWatermark("ts", "10 seconds"))


def _keys(name):
    import spark_stretch
    from pyspark.sql import functions as F

    return F.col("words") if name == "wordcount" else spark_stretch.pairs("words")


def _timed(start) -> float:
    t0 = time.perf_counter()
    q = start()
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(q.exception())
    return time.perf_counter() - t0


def _run_layout(args) -> dict:
    """One layout's runs (in this process: its own driver), as a dict."""
    work = Path(args.work)
    spark = _session(args.layout, args.url, ui=True)
    out = {"layout": args.layout, "queries": {}}
    try:
        for name in [q for q in args.queries.split(",") if q]:
            if name == "sessions":
                out["queries"][name] = _sessions(spark, work, args)
                continue
            agg = _source(spark, work / "tweets").stretchAggregate(
                keys=_keys(name), window=WINDOW, parallelism=LAYOUTS[args.layout][1],
                max_parallelism=LAYOUTS[args.layout][1])
            dst = work / f"{name}-{args.layout}"
            _timed(lambda: agg.writeStream.format("delta")  # (untimed: JIT, class loading)
                   .option("checkpointLocation", str(work / f"warm-{name}-{args.layout}"))
                   .trigger(availableNow=True).start(str(work / f"warm-{name}-{args.layout}")))
            s = _timed(lambda: agg.writeStream.format("delta")
                       .option("checkpointLocation", f"{dst}-ckpt")
                       .trigger(availableNow=True).start(str(dst)))
            out["queries"][name] = {"s": s, "tweets_per_s": args.tweets / s}
            if name == "wordcount" and args.layout == "1x2":
                n = work / "wordcount-native"
                out["queries"][name]["native_s"] = _timed(
                    lambda: agg.native().writeStream.format("delta").outputMode("append")
                    .option("checkpointLocation", f"{n}-ckpt").trigger(availableNow=True)
                    .start(str(n)))
                out["queries"][name]["equal_native"] = _same(spark, n, dst)
            if args.layout == "2x1":  # (the one-host layout ran first)
                out["queries"][name]["equal_1x2"] = _same(spark, work / f"{name}-1x2", dst)
        if args.layout == "2x1" and args.bytes_tweets:
            out["bytes"] = _bytes(spark, work, args)
        if args.layout == "2x1" and args.move_windows:
            out["moves"] = [_move(spark, work, int(n)) for n in args.move_windows.split(",")]
        if args.layout == "2x1" and args.skew_events:
            out["elastic"] = _elastic(spark, work, args)
    finally:
        spark.stop()
    return out


def _sessions(spark, work: Path, args) -> dict:
    """The drop-in's sessionization (``grouped.py``) in this layout, after an untimed run."""
    import grouped
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(grouped)  # (the instances cannot import it)
    par = LAYOUTS[args.layout][1]

    def start(dst):
        return lambda: (grouped.source(spark, work / "events").groupBy("user")
                        .stretchApplyInPandasWithState(*grouped.ARGS, parallelism=par,
                                                       max_parallelism=par)
                        .writeStream.outputMode("update").format("delta")
                        .option("checkpointLocation", f"{dst}-ckpt")
                        .trigger(availableNow=True).start(str(dst)))

    _timed(start(work / f"warm-sessions-{args.layout}"))
    dst = work / f"sessions-{args.layout}"
    s = _timed(start(dst))
    out = {"s": s, "tweets_per_s": args.events / s, "events": args.events}
    if args.layout == "2x1":
        out["equal_1x2"] = _same(spark, work / "sessions-1x2", dst)
    return out


def _same(spark, a, b) -> bool:
    """Whether two Delta tables hold the same rows (``exceptAll`` both ways)."""
    x, y = (spark.read.format("delta").load(str(p)) for p in (a, b))
    return x.count() == y.count() and x.exceptAll(y).isEmpty() and y.exceptAll(x).isEmpty()


def _shuffle_bytes(spark) -> int:
    """Bytes native Spark wrote to its shuffle in this application so far (REST API)."""
    ui = spark.sparkContext.uiWebUrl
    app = spark.sparkContext.applicationId
    with urllib.request.urlopen(f"{ui}/api/v1/applications/{app}/stages", timeout=30) as r:
        return sum(int(s.get("shuffleWriteBytes", 0)) for s in json.loads(r.read()))


def _bytes(spark, work: Path, args) -> dict:
    """Rows path on two hosts: bytes over TCP between hosts per tweet, against native's shuffle."""
    src, res = work / "tweets-small", {}
    spark.conf.set("spark.stretch.ingest.files", "false")
    try:
        for name in [q for q in args.queries.split(",") if q]:
            agg = _source(spark, src, per_batch=2).stretchAggregate(
                keys=_keys(name), window=WINDOW, max_parallelism=1)
            dst = work / f"bytes-{name}"
            q = (agg.writeStream.format("delta").option("checkpointLocation", f"{dst}-ckpt")
                 .trigger(availableNow=True).start(str(dst)))
            q.awaitTermination()
            tcp = sum(h["bytes_in"]["tcp"] for h in q.metrics()["engine"]["hosts"])
            before = _shuffle_bytes(spark)
            n = work / f"bytes-{name}-native"
            _timed(lambda: agg.native().writeStream.format("delta").outputMode("append")
                   .option("checkpointLocation", f"{n}-ckpt").trigger(availableNow=True)
                   .start(str(n)))
            native = _shuffle_bytes(spark) - before
            res[name] = {"stretch_tcp_bytes_per_tweet": tcp / args.bytes_tweets,
                         "native_shuffle_bytes_per_tweet": native / args.bytes_tweets,
                         "ratio": tcp / native if native else None,
                         "equal": _same(spark, n, dst)}
    finally:
        spark.conf.unset("spark.stretch.ingest.files")
    return res


def _move(spark, work: Path, n: int) -> dict:
    """~``n`` live windows (n users, one window each) on two hosts: move every key group to one
    host; against Spark's stop + repartition + restart of the native query's RocksDB state."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    src = work / f"move-{n}"
    src.mkdir()
    # n users a microsecond apart in one hour's window, then one tuple 2 s later: the engine
    # keeps a tuple in its ESG until the watermark (delay 0) passes it, so after the second
    # batch every user's window is live in the buckets (and in Spark's state store).
    t0 = 1_700_000_000_000_000 - 1_700_000_000_000_000 % 3_600_000_000
    for i, (ts, users) in enumerate([(t0 + np.arange(n), [f"u{i}" for i in range(n)]),
                                     (np.array([t0 + n + 2_000_000]), ["late"])]):
        pq.write_table(pa.table({"ts": pa.array(ts, pa.timestamp("us", "UTC")), "user": users}),
                       src / f"{i}.parquet")
    read = (spark.readStream.option("maxFilesPerTrigger", 1)
            .schema("ts TIMESTAMP, user STRING").parquet(str(src))
            .withWatermark("ts", "0 seconds"))
    agg = read.stretchAggregate(keys=F.col("user"), window="1 hour", max_parallelism=1)
    dst = work / f"move-{n}-out"
    q = (agg.writeStream.format("delta").option("checkpointLocation", f"{dst}-ckpt")
         .trigger(processingTime="1 second").start(str(dst)))
    while q.metrics().get("batches", 0) < 2:
        time.sleep(0.1)
    hosts = [h["host"] for h in q.metrics()["engine"]["hosts"]]
    live = q.metrics()["engine"]["live_windows"]
    assert live >= n // 2, f"{live} live windows of {n} users: the move would move little"
    rec = q.reconfigure(key_groups={hosts[0]: 64, hosts[1]: 0})
    back = q.reconfigure(key_groups={hosts[0]: 32, hosts[1]: 32})
    q.stop()
    # Spark's route for the same state: the native query (RocksDB), stopped, repartitioned, restarted
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    nck = work / f"move-{n}-native-ckpt"
    nq = (agg.native().writeStream.format("noop").outputMode("append")
          .option("checkpointLocation", str(nck)).trigger(availableNow=True).start())
    nq.awaitTermination()
    # (the restart runs one batch, one new tuple: Spark loads the state a batch touches)
    pq.write_table(pa.table({"ts": pa.array([t0 + n + 3_000_000], pa.timestamp("us", "UTC")),
                             "user": ["next"]}), src / "2.parquet")
    t0 = time.perf_counter()
    spark._streamingCheckpointManager.repartition(str(nck), 1)
    t1 = time.perf_counter()
    _timed(lambda: agg.native().writeStream.format("noop").outputMode("append")
           .option("checkpointLocation", str(nck)).trigger(availableNow=True).start())
    t2 = time.perf_counter()
    spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
    return {"windows": live, "move_ms": rec["switch_ms"], "back_ms": back["switch_ms"],
            "moved_groups": rec["moved_groups"], "spark_repartition_s": t1 - t0,
            "spark_restart_s": t2 - t1}


def _skewed(folder: Path, n: int, files: int, groups: int) -> None:
    """``n`` events ``(ts, k, v)`` in ``files`` files, Zipf-skewed keys (s = 1.1 over 100,000
    ranks) whose 32 heaviest lie in the key groups of the first host's balanced share."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_stretch.engine.hashing import xxhash64
    from spark_stretch.protocol.placement import balanced_host_map, key_group
    from spark_stretch.testing.stepped import events_table

    cand = np.arange(200_000, dtype=np.int64)
    first = balanced_host_map(groups, 2)[key_group(xxhash64(pa.array(cand)), groups)] == 0
    hot = cand[first][:32]
    rank = np.concatenate([hot, np.setdiff1d(cand, hot)[:100_000 - 32]])
    folder.mkdir()
    for f in range(files):
        t = events_table(n // files, start_s=10.0 * f, rate=n / files / 10.0, keys=100_000,
                         zipf=1.1, seed=f)
        t = t.set_column(1, "k", pa.array(rank[t.column("k").to_numpy()]))
        path = folder / f"events-{f:06d}.parquet"
        pq.write_table(t, path)
        os.utime(path, (1e9 + f, 1e9 + f))  # (the order the source reads them in)


def _elastic(spark, work: Path, args) -> dict:
    """Skewed keys on two hosts: the static host map against an elastic policy's moves, each
    run twice, alternated (the best of each compared)."""
    from spark_stretch import ElasticPolicy
    from spark_stretch.testing.stepped import event_source

    src = work / "skewed"
    _skewed(src, args.skew_events, args.files, 64)
    out = {"static": {"s": []}, "elastic": {"s": []}}
    warm = event_source(spark, src).stretchAggregate(keys="k", window="10 seconds",
                                                     max_parallelism=1)
    _timed(lambda: warm.writeStream.format("delta")  # (untimed: JIT, class loading, engines)
           .option("checkpointLocation", str(work / "skew-warm-ckpt"))
           .trigger(availableNow=True).start(str(work / "skew-warm")))
    for run in range(4):
        name, policy = ("static", None) if run % 2 == 0 else ("elastic", ElasticPolicy())
        agg = event_source(spark, src).stretchAggregate(keys="k", window="10 seconds",
                                                        max_parallelism=1, elastic=policy)
        dst = work / f"skew-{name}-{run}"
        q = {}
        out[name]["s"].append(_timed(lambda: q.setdefault("q", agg.writeStream.format("delta")
                                     .option("checkpointLocation", f"{dst}-ckpt")
                                     .trigger(availableNow=True).start(str(dst)))))
        m = q["q"].metrics()
        out[name].update(
            host_imbalance=[r["host_imbalance"] for r in m["per_batch"]],
            moves=[{k: r[k] for k in ("after_batch", "moved_groups", "switch_ms", "key_groups")}
                   for r in m.get("reconfigurations", []) if r["cause"] == "rebalance_hosts"])
        if run == 0:
            n = work / "skew-native"
            _timed(lambda: agg.native().writeStream.format("delta").outputMode("append")
                   .option("checkpointLocation", f"{n}-ckpt").trigger(availableNow=True)
                   .start(str(n)))
            out[name]["equal_native"] = _same(spark, n, dst)
        else:
            out[name][f"equal_static_{run}"] = _same(spark, work / "skew-static-0", dst)
    for r in out.values():
        r["best_s"] = min(r["s"])
        r["events_per_s"] = args.skew_events / r["best_s"]
    out["speedup"] = out["static"]["best_s"] / out["elastic"]["best_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tweets", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--queries", default="wordcount,paircount-H")
    ap.add_argument("--bytes-tweets", type=int, default=100_000)
    ap.add_argument("--events", type=int, default=1_000_000, help="the drop-in's events")
    ap.add_argument("--users", type=int, default=100_000, help="the drop-in's users")
    ap.add_argument("--move-windows", default="10000,1000000")
    ap.add_argument("--skew-events", type=int, default=2_000_000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layout:
        print("RESULT " + json.dumps(_run_layout(args)), flush=True)
        return
    from spark_stretch.testing import write_tweets
    from spark_stretch.testing.cluster import StandaloneCluster

    with bench_run("stretch-bench-hosts-") as bench:
        work = bench.path
        if any(q != "sessions" for q in args.queries.split(",") if q):
            write_tweets(work / "tweets", args.tweets, files=args.files, rate=1000.0, seed=1)
        if "sessions" in args.queries.split(","):
            import grouped

            grouped.write_events(work / "events", args.events, args.users, args.files, seed=1)
        if args.bytes_tweets:
            write_tweets(work / "tweets-small", args.bytes_tweets, files=4, rate=1000.0, seed=2)
        report = {"tweets": args.tweets, "layouts": {}}
        for layout, (hosts, cores) in LAYOUTS.items():
            if layout == "1x2" and not args.queries:
                continue
            with StandaloneCluster(hosts=hosts, cores=cores, memory="3g") as cluster:
                cmd = [sys.executable, __file__, "--layout", layout, "--url", cluster.url,
                       "--work", str(work), "--tweets", str(args.tweets), "--queries",
                       args.queries, "--bytes-tweets", str(args.bytes_tweets),
                       "--move-windows", args.move_windows,
                       "--skew-events", str(args.skew_events), "--files", str(args.files),
                       "--events", str(args.events), "--users", str(args.users)]
                p = subprocess.run(cmd, capture_output=True, text=True,
                                   env=dict(os.environ, PYSPARK_PYTHON=sys.executable))
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    raise RuntimeError(f"layout {layout} failed:\n{p.stdout[-3000:]}"
                                       f"{p.stderr[-5000:]}")
                report["layouts"][layout] = json.loads(line[0][len("RESULT "):])
    one = report["layouts"].get("1x2", {}).get("queries", {})
    two = report["layouts"]["2x1"]["queries"]
    for name in one:
        report.setdefault("ratios", {})[name] = two[name]["tweets_per_s"] / one[name]["tweets_per_s"]
    print(json.dumps(report, indent=None if args.json else 1))
    checks = [v for q in two.values() for k, v in q.items() if k.startswith("equal")]
    checks += [v for q in one.values() for k, v in q.items() if k.startswith("equal")]
    checks += [b["equal"] for b in report["layouts"]["2x1"].get("bytes", {}).values()]
    checks += [v for r in report["layouts"]["2x1"].get("elastic", {}).values()
               if isinstance(r, dict) for k, v in r.items() if k.startswith("equal")]
    if not all(checks):
        sys.exit("outputs differ between the layouts (or native Spark)")


if __name__ == "__main__":
    main()
