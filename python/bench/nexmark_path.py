"""Where a Nexmark query's micro-batches go through ``stretch(df)``, batch by batch, beside the
floor (the bids read and dropped): what bounds it against the floor.

    python python/bench/nexmark_path.py [--events 10000000] [--files 10] [--queries q17,q5]
                                        [--repeat 3] [--busy] [--json out.json]
                                        [--plot out.png]

The set-up of ``nexmark.py`` (the same events, one file a micro-batch, availableNow, local[2],
shuffle partitions 2, driver memory 4g), each query run through ``stretch(df)`` into Delta
``--repeat`` times after an untimed warm-up, and the floor as many times, alternating. For
each run: its wall time, the time from the query's start to its first trigger and from its
last trigger's end to the return of ``awaitTermination``; for each micro-batch, Spark's own
durations (``triggerExecution`` and its parts: ``latestOffset``, ``walCommit``,
``queryPlanning``, ``addBatch``, ``commitOffsets``), the driver's figures of the batch (the
engine taking its input while Spark waits, the wait for the batch before it, the engine's
step and its Delta append after Spark's commit), and the CPU time of Spark's JVM and of the
engine's process within the trigger (``/proc/<pid>/stat``, sampled every 10 ms), as cores
used. A summary per run, a batch on average: from the third batch to the last with input (past
the first batches' warm-up, before the no-data batch), against the floor's. Each query's table is checked equal to native Spark's (one native
run, exceptAll both ways). ``--busy``: the floor also with a busy loop beside it at nice 19
(one Python process spinning), for what any work beside Spark on the same cores costs it.
``--plot``: each batch's parts, of the median run of each kind, for the first query (PNG).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nexmark_gen as gen  # noqa: E402
import spark_stretch  # noqa: E402
from nexmark import CONF, from_files, on_engine, queries, same_tables  # noqa: E402
from spark_stretch.driver.engine import HostEngine  # noqa: E402
from workdir import bench_run  # noqa: E402

_HZ = os.sysconf("SC_CLK_TCK")


class _Cpu:
    """CPU seconds of the JVM and of the driver's other children (the engine), sampled."""

    def __init__(self, jvm: int):
        self.jvm = jvm
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _of(pid: int) -> float:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / _HZ
        except (OSError, IndexError):
            return 0.0

    def _children(self) -> list:
        out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split() if int(p) != self.jvm]

    def _run(self) -> None:
        engines, k = [], 0
        while not self._stop.is_set():
            if k % 10 == 0:
                engines = self._children()
            k += 1
            self.samples.append((time.time(), self._of(self.jvm),
                                 sum(self._of(p) for p in engines)))
            time.sleep(0.01)

    def between(self, t0: float, t1: float) -> tuple:
        """(JVM, engine) CPU seconds from ``t0`` to ``t1`` (the samples before each)."""
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        upto = [s for s in self.samples if s[0] <= t1] or self.samples[:1]
        return upto[-1][1] - before[-1][1], upto[-1][2] - before[-1][2]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _batches(q, cpu: _Cpu, figures: list) -> list:
    rows = []
    for p in q.recentProgress:
        start = datetime.datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
        d = p["durationMs"]
        jvm, eng = cpu.between(start, start + d["triggerExecution"] / 1e3)
        f = next((x for x in figures if x.get("batch") == p["batchId"]), {})
        rows.append({"batch": p["batchId"], "start": start, "trigger_ms": d["triggerExecution"],
                     "input_rows": int(p["numInputRows"]),
                     **{k: d.get(k, 0) for k in ("latestOffset", "walCommit", "queryPlanning",
                                                 "addBatch", "commitOffsets")},
                     "jvm_cpu_ms": jvm * 1e3, "engine_cpu_ms": eng * 1e3,
                     **{k: round(f.get(k, 0) * 1e3) for k in ("ingest_s", "previous_s",
                                                              "engine_s", "output_s")}})
    return rows


def _print(name: str, run: dict) -> None:
    print(f"{name}: {run['wall_s']:.2f} s (start to first trigger {run['start_s']:.2f} s, last "
          f"trigger's end to return {run['end_s']:.2f} s)", flush=True)
    for b in run["batches"]:
        line = (f"  batch {b['batch']:2d} {b['trigger_ms']:4d} ms: offsets {b['latestOffset']:3d}"
                f" wal {b['walCommit']:3d} plan {b['queryPlanning']:3d} addBatch "
                f"{b['addBatch']:4d} commit {b['commitOffsets']:3d}; cores "
                f"{(b['jvm_cpu_ms'] + b['engine_cpu_ms']) / max(b['trigger_ms'], 1):.2f}")
        if b["ingest_s"] or b["engine_s"]:
            line += (f"; engine takes {b['ingest_s']:3d}, previous {b['previous_s']:3d}, step "
                     f"{b['engine_s']:3d}, append {b['output_s']:3d}")
        print(line)
    s = run["steady"]
    print(f"  batches 2-{s['last']}, a batch: {s['ms']:.0f} ms, Spark's bookkeeping (offsets, "
          f"wal, plan, commit) {s['bookkeeping_ms']:.0f} ms, addBatch {s['addBatch_ms']:.0f} ms, "
          f"cores {s['cores']:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--queries", default="q17,q5")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--busy", action="store_true",
                    help="the floor also run with a busy loop beside it at nice 19")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        bench = stack.enter_context(bench_run("stretch-bench-nexmark-path-"))
        work = bench.path
        gen.write(work / "events", args.events, args.files, seed=1)
        spark = bench.session(spark_stretch.session(app_name="bench nexmark path",
                                                    conf=dict(CONF)))
        spark.sparkContext.setLogLevel("ERROR")
        jvm = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())

        def reader(kind, schema):
            return lambda: from_files(spark, work / "events", kind, schema)

        sources = (reader("bid", gen.BID_SCHEMA), reader("auction", gen.AUCTION_SCHEMA),
                   reader("person", gen.PERSON_SCHEMA))
        qs = queries(*sources)
        stretched = queries(*sources, wrap=on_engine)  # (each stage of a chain on the engine)

        def run(make, out: Path, sink: str = "delta", busy: bool = False) -> dict:
            spark.sparkContext._jvm.System.gc()  # (untimed)
            cpu = _Cpu(jvm)
            spin = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while 1: pass"]
                                    ) if busy else None
            t0 = time.time()
            q = (make().writeStream.format(sink).option("checkpointLocation", f"{out}-ckpt")
                 .trigger(availableNow=True).start(*([] if sink == "noop" else [str(out)])))
            control = spark_stretch.control(q) if sink == "delta" else None
            q.awaitTermination()
            t1 = time.time()
            if spin is not None:
                spin.kill()
                spin.wait()
            figures = []
            if control is not None:
                m = control.metrics()
                figures = (m.get("aggregations") or [m])[0].get("batch_times", [])
            HostEngine.wait_stopped(30)  # (the next run starts its own engine)
            cpu.stop()
            if q.exception():
                raise RuntimeError(q.exception())
            batches = _batches(q, cpu, figures)
            # (past the first two; not the no-data batch closing the last windows)
            steady = [b for b in batches if b["batch"] >= 2 and b["input_rows"] > 0]
            ms = sum(b["trigger_ms"] for b in steady)
            last = batches[-1]
            return {"wall_s": t1 - t0, "start_s": batches[0]["start"] - t0,
                    "end_s": t1 - last["start"] - last["trigger_ms"] / 1e3, "batches": batches,
                    "steady": {"last": steady[-1]["batch"], "ms": ms / len(steady),
                               "cores": sum(b["jvm_cpu_ms"] + b["engine_cpu_ms"]
                                            for b in steady) / max(ms, 1),
                               "bookkeeping_ms": sum(b[k] for b in steady for k in (
                                   "latestOffset", "walCommit", "queryPlanning",
                                   "commitOffsets")) / len(steady),
                               "addBatch_ms": sum(b["addBatch"] for b in steady) / len(steady)}}

        results = {}
        chosen = args.queries.split(",")
        run(lambda: on_engine(stretched[chosen[0]]()), work / "warm")  # (untimed: JVM, kernels)
        run(qs["q0"], work / "warm-floor", sink="noop")
        for name in chosen:
            run(qs[name], work / f"{name}-native")
            for i in range(args.repeat):
                runs = [("floor", qs["q0"], "noop", False),
                        (name, lambda: on_engine(stretched[name]()), "delta", False)]
                if args.busy:
                    runs.append(("floor-busy", qs["q0"], "noop", True))
                for label, make, sink, busy in runs:
                    got = run(make, work / f"{label}-{name}-{i}", sink, busy)
                    _print(f"{name} stretch(df) (run {i + 1})" if label == name
                           else f"{label} (beside {name}, run {i + 1})", got)
                    results.setdefault(label if label == name else f"{label}-{name}",
                                       []).append(got)
            equal, rows = same_tables(spark, work / f"{name}-native",
                                      work / f"{name}-{name}-{args.repeat - 1}")
            results[f"{name}-equal"] = {"equal": equal, "rows": rows}
            print(f"{name}: equal to native {equal} ({rows:,} rows)", flush=True)
            if not equal:
                raise SystemExit(f"{name}: stretch(df)'s table differs from native Spark's")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        if args.plot:
            _plot(results, chosen[0], Path(args.plot))


_PARTS = (("latestOffset", "offsets"), ("walCommit", "offset log"),
          ("queryPlanning", "planning"), ("addBatch", "addBatch (the sink: read, or the "
                                                      "engine taking the batch)"),
          ("commitOffsets", "commit log"))


def _plot(results: dict, name: str, path: Path) -> None:
    """Stacked bars of each batch's parts, the median run (by wall time) of each kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [(k, t) for k, t in ((f"floor-{name}", "floor (bids read, noop sink)"),
                                 (name, f"{name} through stretch(df), into Delta"),
                                 (f"floor-busy-{name}", "floor, a busy loop beside it"))
             if k in results]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), sharey=True,
                             squeeze=False)
    for ax, (key, title) in zip(axes[0], kinds):
        runs = sorted(results[key], key=lambda r: r["wall_s"])
        run = runs[len(runs) // 2]
        batches = run["batches"]
        bottom = [0.0] * len(batches)
        for part, label in _PARTS:
            h = [b[part] for b in batches]
            ax.bar([b["batch"] for b in batches], h, bottom=bottom, label=label)
            bottom = [x + y for x, y in zip(bottom, h)]
        ax.set_title(f"{title}\n{run['wall_s']:.2f} s", fontsize=9)
        ax.set_xlabel("micro-batch")
    axes[0][0].set_ylabel("ms")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
