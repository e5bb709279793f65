"""Aggregation state at scale: memory per live window and time, native Spark (RocksDB) against
``stretch(df)``, side by side in one run.

    python python/bench/aggstate.py [--keys 1000000] [--files 10] [--no-native]
                                    [--state-memory 128m] [--json]
    python python/bench/aggstate.py --plot out.png RUN.json [RUN.json ...]

The query, as a Spark user writes it (bigint users, a 1-hour tumbling window)::

    df.withWatermark("ts", "10 minutes")
      .groupBy(F.window("ts", "1 hour"), "user")
      .agg(F.count("*").alias("n"), F.sum("x").alias("s"), F.max("x").alias("m"))

over a parquet stream of ``3 * keys`` events (``--files`` files = micro-batches, availableNow,
local[2]): users drawn uniformly from ``keys`` random bigint ids (3 events per key on average,
about 0.95 * keys distinct), event time rising through one hour, so every window stays live
until one last event three hours later closes them all and both sides emit every window
(append mode, into Delta). Tables checked equal (exceptAll both ways).

Reported per side: time and events/s; for the engine, its processes' peak resident memory
(VmHWM of the host engine and its instance processes, read every 0.2 s, and after the query
ends until it settles: the engine writes the last batch's checkpoint after it; and their RSS
polled every 2 ms, as VmHWM misses peaks given back by ``madvise``), the live
windows before the closing batch, and bytes per live window: the peak RSS over live windows,
and the same with the engine's RSS at its start subtracted (the interpreter, numba's code and
pyarrow, which do not grow with the state). The peak may be the
closing batch's where it emits more than a batch holds (every window at once);
``live_rss_bytes`` is the largest RSS sampled while the windows were live, between batches;
``live_peak_rss_bytes`` the peak while they were live, inside batches too (a batch's working
set, a table's grow): the issue's measure, peak RSS over live windows, before the closing one.
``AGGSTATE_TRACE=1`` prints the engine's RSS as the batches go. ``--plot`` draws runs saved with
``--json`` (one a size): bytes per live window and events/s against the keys (PNG).

Fair set-up for native Spark: the same session (local[2], spark.driver.memory=4g),
spark.sql.shuffle.partitions=2 (one per core), the RocksDB state store provider (state larger
than memory on disk, as users run large state).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import functions as F

import spark_stretch
from workdir import bench_run

SCHEMA = "ts TIMESTAMP, user BIGINT, x BIGINT"
HOUR_S = 3_600
T0 = 472_222 * HOUR_S * 1_000_000  # us, an hour boundary (2023-11-14 22:00 UTC)
HOUR = 3_600 * 1_000_000


def write_events(dst: Path, keys: int, files: int, seed: int = 7) -> int:
    """``3 * keys`` events over ``files`` parquet files (event time rising through one hour),
    then a last file of one event three hours on (closing every window). Returns the events."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 1 << 62, size=keys, dtype=np.int64)  # (random bigints, distinct enough)
    n, step = 3 * keys, HOUR // files
    per = -(-n // files)
    dst.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        m = min(per, n - f * per)
        ts = T0 + f * step + rng.integers(0, step, size=m)
        t = pa.table({"ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                      "user": ids[rng.integers(0, keys, size=m)],
                      "x": rng.integers(0, 1_000_000, size=m)})
        pq.write_table(t, dst / f"part-{f:04d}.parquet")
    last = pa.table({"ts": pa.array([T0 + 3 * HOUR], pa.timestamp("us", tz="UTC")),
                     "user": pa.array([0], pa.int64()), "x": pa.array([0], pa.int64())})
    pq.write_table(last, dst / f"part-{files:04d}.parquet")
    return n + 1


def query(spark, src: Path):
    return (spark.readStream.option("maxFilesPerTrigger", 1).schema(SCHEMA).parquet(str(src))
            .withWatermark("ts", "10 minutes")
            .groupBy(F.window("ts", "1 hour"), "user")
            .agg(F.count("*").alias("n"), F.sum("x").alias("s"), F.max("x").alias("m")))


class Peak(threading.Thread):
    """The engine's processes' peak RSS (VmHWM, and their RSS polled) and live windows, read
    while the query runs."""

    def __init__(self, q):
        super().__init__(daemon=True)
        self.q, self.hwm, self.live, self.base, self.stop = q, {}, 0, None, False
        self.pids: list = []
        self.polled = self.polled_since = 0  # (see poll)
        self.done = False  # (the query and the engine's work for it ended: polling stops)
        self.live_rss = 0  # (the largest RSS sampled while windows are live, between batches)
        self.live_peak = 0  # (the peak RSS while windows are live, inside batches too)
        self.disk = 0  # (the largest state on disk reported)
        self.trace = bool(int(os.environ.get("AGGSTATE_TRACE", "0")))

    def poll(self):
        """The processes' RSS every 2 ms: VmHWM misses a peak whose pages went back by
        ``madvise`` (the kernel updates it on unmaps and at exit only), as the engine gives its
        heap and tables back; ``polled`` the largest sum seen, ``polled_since`` since the last
        reading of the metrics."""
        while not self.done:
            try:
                rss = sum(_status(pid, "VmRSS") for pid in self.pids)
                self.polled = max(self.polled, rss)
                self.polled_since = max(self.polled_since, rss)
            except OSError:  # (the process ended)
                pass
            time.sleep(0.002)

    def run(self):
        pids = []
        threading.Thread(target=self.poll, daemon=True).start()
        while not self.stop:
            try:
                # (read before the lock: see below)
                hwm_before = max(sum(self._hwm(pids).values()), self.polled_since)
                self.polled_since = 0
                m = self.q.metrics()["engine"]
                pids = [p for p in m.get("instance_pids", []) + [m.get("engine_pid")] if p]
                self.pids = pids
                rss = 0
                for pid in pids:
                    with open(f"/proc/{pid}/status") as f:
                        for ln in f:
                            if ln.startswith("VmHWM"):
                                self.hwm[pid] = int(ln.split()[1]) * 1024
                            elif ln.startswith("VmRSS"):
                                rss += int(ln.split()[1]) * 1024
                            if ln.startswith("VmRSS") and self.trace:
                                print(f"trace batch={m.get('batches')} live={m.get('live_windows')} "
                                      f"rss={int(ln.split()[1]) >> 10} MB", file=sys.stderr)
                live = int(m.get("live_windows") or 0)
                if live and live >= self.live:
                    self.live_rss = max(self.live_rss, rss)
                    # (metrics() waits for a batch to end; the peak read before it is the
                    # processes' peak while these windows were live, batches' insides with it)
                    self.live_peak = max(self.live_peak, hwm_before)
                self.live = max(self.live, live)
                if self.base is None and self.hwm:  # (the first reading: the engine at its start)
                    self.base = sum(self.hwm.values())
                last = self.q.lastProgress
                so = json.loads(last.json)["stateOperators"] if last is not None else []
                if so:  # (past a memory budget: the tables' files, under the name the
                    #      configured state store gives its own: RocksDB's here)
                    cm = so[0]["customMetrics"]
                    disk = cm.get("rocksdbSstFileSize") or cm.get("stateOnCurrentVersionSizeBytes", 0)
                    self.disk = max(self.disk, int(disk))
            except Exception:
                pass
            time.sleep(0.2)

    def finally_read(self, settle_s: float = 2.0, most_s: float = 60.0) -> dict:
        """The processes' VmHWM once the query ended (those still alive), read until it has
        not changed for ``settle_s`` (the engine still writes the last batch's checkpoint
        when Spark's query ends)."""
        got, since, t0 = {}, time.monotonic(), time.monotonic()
        while time.monotonic() - since < settle_s and time.monotonic() - t0 < most_s:
            try:
                now = self._hwm(self.pids)
            except OSError:
                return got
            if now != got:
                got, since = now, time.monotonic()
            time.sleep(0.1)
        return got

    @staticmethod
    def _hwm(pids) -> dict:
        return {pid: _status(pid, "VmHWM") for pid in pids}


def _status(pid: int, key: str) -> int:
    """Bytes of ``key`` (VmRSS, VmHWM) in ``/proc/<pid>/status``; 0 for a process that has
    exited and not yet been reaped (a zombie has neither line)."""
    with open(f"/proc/{pid}/status") as f:
        return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":")), 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--files", type=int, default=10)
    p.add_argument("--no-native", dest="native", action="store_false")
    p.add_argument("--state-memory", default=None,
                   help="spark.stretch.state.memory for the engine (e.g. 128m): its tables past "
                        "it in files on local disk")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default="", help="draw the runs given (JSON files) into this PNG")
    p.add_argument("runs", nargs="*", help="(with --plot) runs saved with --json")
    a = p.parse_args()
    if a.plot:
        return plot([json.loads(Path(f).read_text()) for f in a.runs], a.plot)
    with bench_run("aggstate-") as bench:
        _main(a, bench)


def _main(a, bench) -> None:
    tmp = bench.path
    src = tmp / "events"
    events = write_events(src, a.keys, a.files)
    conf = {"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g",
            "spark.sql.streaming.stateStore.providerClass":
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"}
    spark = bench.session(spark_stretch.session(conf=conf))
    res = {"keys": a.keys, "events": events, "files": a.files,
           "state_memory": a.state_memory}
    if a.state_memory:
        spark.conf.set("spark.stretch.state.memory", a.state_memory)

    def run(df, name):
        t0 = time.perf_counter()
        q = (df.writeStream.format("delta").outputMode("append")
             .option("checkpointLocation", str(tmp / f"{name}-ckpt"))
             .trigger(availableNow=True).start(str(tmp / name)))
        peak = None
        if name == "stretch":
            peak = Peak(q)
            peak.start()
        q.awaitTermination()
        s = time.perf_counter() - t0
        if peak is not None:
            peak.stop = True
            peak.join()
            # (the engine outlives the query, its VmHWM kept: read again once its last work for
            # the query, the last batch's checkpoint written in the background, is done)
            peak.hwm.update(peak.finally_read())
            peak.done = True
        return s, peak

    if a.native:
        res["native_s"], _ = run(query(spark, src), "native")
    res["stretch_s"], peak = run(spark_stretch.stretch(query(spark, src)), "stretch")
    rss = max(sum(peak.hwm.values()), peak.polled)
    res.update(stretch_peak_rss_bytes=rss, live_windows=peak.live,
               stretch_base_rss_bytes=peak.base, live_rss_bytes=peak.live_rss,
               live_peak_rss_bytes=peak.live_peak, state_disk_bytes=peak.disk,
               live_bytes_per_window=peak.live_rss / max(peak.live, 1),
               live_peak_bytes_per_window=peak.live_peak / max(peak.live, 1),
               bytes_per_window=rss / max(peak.live, 1),
               bytes_per_window_above_base=(rss - (peak.base or 0)) / max(peak.live, 1))
    print("stretch:", json.dumps(res), file=sys.stderr, flush=True)  # (before the long check)
    got = spark.read.format("delta").load(str(tmp / "stretch"))
    if a.native:
        want = spark.read.format("delta").load(str(tmp / "native"))
        res["throughput_ratio"] = res["native_s"] / res["stretch_s"]
    else:  # a batch SQL query over the same files
        want = (spark.read.schema(SCHEMA).parquet(str(src)).where(f"ts < timestamp_micros({T0 + HOUR})")
                .groupBy(F.window("ts", "1 hour"), "user")
                .agg(F.count("*").alias("n"), F.sum("x").alias("s"), F.max("x").alias("m")))
    res["rows"] = got.count()
    res["equal"] = res["rows"] == want.count() and got.exceptAll(want).isEmpty() \
        and want.exceptAll(got).isEmpty()
    for side in ("native", "stretch"):
        if f"{side}_s" in res:
            res[f"{side}_events_per_s"] = events / res[f"{side}_s"]
    print(json.dumps(res) if a.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    if not res["equal"]:
        sys.exit("outputs differ")


def plot(runs: list, path: str) -> None:
    """Runs of ``--json`` (with native beside it) drawn against their keys: the engine's peak
    bytes per live window (while live, and with the closing batch), its start's share of them,
    and the issue's 100 B; both sides' events/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: r["keys"])
    keys = [r["keys"] / 1e6 for r in runs]
    fig, (mem, rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    mem.plot(keys, [r["live_peak_bytes_per_window"] for r in runs], "o-",
             label="stretch(df), peak while windows are live")
    mem.plot(keys, [r["bytes_per_window"] for r in runs], "s--",
             label="stretch(df), peak with the closing batch")
    mem.plot(keys, [r["stretch_base_rss_bytes"] / r["live_windows"] for r in runs], "^:",
             label="the engine at its start (before any state)")
    mem.axhline(100, color="grey", lw=0.8, ls=":", label="100 B (the target)")
    mem.set(xscale="log", xlabel="keys (millions)", ylabel="engine RSS / live windows (B)",
            title="memory per live window", ylim=(0, None))
    rate.plot(keys, [r["stretch_events_per_s"] / 1e3 for r in runs], "o-",
              label="stretch(df)")
    rate.plot(keys, [r.get("native_events_per_s", float("nan")) / 1e3 for r in runs], "s-",
              label="native Spark, RocksDB")
    for k, r in zip(keys, runs):
        if "throughput_ratio" in r:
            rate.annotate(f"{r['throughput_ratio']:.1f}x", (k, r["stretch_events_per_s"] / 1e3),
                          textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    rate.set(xscale="log", yscale="log", xlabel="keys (millions)",
             ylabel="thousand events/s", title="throughput (3 events a key)")
    for ax in (mem, rate):
        ax.set_xticks(keys, [f"{k:g}" for k in keys])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=8)
    fig.suptitle("groupBy(window(ts, '1 hour'), user).agg(count, sum, max) into Delta, "
                 "local[2]", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
