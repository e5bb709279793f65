"""An elastic query against static ones on a stepped input rate (STRETCH's Q5, Fig. 11).

    python python/bench/elastic.py [--low 5000] [--high 150000] [--phase 30] [--max 2]
                                   [--trigger 1] [--runs static1,staticmax,elastic]
                                   [--plots DIR] [--json]

The same live stream (``testing.stepped.publish_steps``: a file every ``--trigger`` seconds,
``--low`` events a second for ``--phase`` seconds, then ``--high``, then ``--low`` again; event
times are the wall clock, so the event-time latency is real) goes, one run after the other,
through the same query: a sliding-window count per key (10 s windows every 1 s, watermark
2 s), ``stretchAggregate`` into a local Delta table with a processing-time trigger of
``--trigger`` seconds, at a static parallelism of 1, at a static ``--max``, and elastic
(``elastic=True``, between 1 and ``--max``).

Reported per run (from ``q.metrics()``):

- p99 event-time latency per phase (the median over the phase's batches of each batch's p99,
  output written minus window end) and around each step (the largest batch p99 in the three
  batches from the step's first batch);
- reaction to each step (elastic): batches from the step's first batch to the first batch run
  at the new parallelism, and seconds from the step's first file to the switch;
- switch durations: the engine's epoch switch (``switch_ms``) and the driver's request;
- cores: busy core-seconds (the instances' busy time), allocated core-seconds (parallelism
  times the batch's wall time, what a scheduler would reserve) and the host engine process's
  CPU seconds (/proc: everything it did, its own Delta appends included).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import spark_stretch
from workdir import bench_run
from spark_stretch.driver.engine import HostEngine
from spark_stretch.testing.stepped import event_source, publish_steps, steps

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return float("nan")


def run(spark, name: str, sizes, args, work: Path) -> dict:
    """One run over a fresh live stream; its figures."""
    src, out = work / name / "events", work / name / "counts"
    src.mkdir(parents=True)
    static = name != "elastic"
    par = 1 if name == "static1" else args.max
    agg = event_source(spark, src, delay="2 seconds").stretchAggregate(
        keys="k", window=("10 seconds", "1 second"), parallelism=par if static else 1,
        max_parallelism=args.max, elastic=None if static else True)
    publisher = publish_steps(src, sizes, interval_s=args.trigger, keys=args.keys, seed=7)
    q = (agg.writeStream.format("delta").option("checkpointLocation", str(work / name / "c"))
         .trigger(processingTime=f"{args.trigger} seconds").start(str(out)))
    while publisher.is_alive() or q.metrics()["batches"] < len(sizes):
        if not q.isActive:
            raise RuntimeError(f"{name}: the query ended: {q.exception()}")
        time.sleep(0.5)
    q.processAllAvailable()
    engine = HostEngine._current
    cpu = _cpu_s(engine.pid) if engine is not None else float("nan")
    q.stop()
    m = q.metrics()
    return {"name": name, "sizes": list(sizes), "published": publisher.published,
            "per_batch": m["per_batch"], "reconfigurations": m["reconfigurations"],
            "engine_cpu_s": cpu}


def summarize(r: dict, args) -> dict:
    rows = sorted(r["per_batch"], key=lambda x: x["batch"])
    sizes = r["sizes"]
    steps_at = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]  # file index
    # the batch that read the step's first file (maxFilesPerTrigger=1: file i is batch i)
    first = [min(i, len(rows) - 1) for i in steps_at]
    p99 = np.array([np.nan if x["latency_p99_ms"] is None else x["latency_p99_ms"]
                    for x in rows])
    bounds = [0] + first + [len(rows)]
    phases = [float(np.nanmedian(p99[a:b])) if np.isfinite(p99[a:b]).any() else None
              for a, b in zip(bounds, bounds[1:])]
    around = [float(np.nanmax(p99[b:b + 3])) if np.isfinite(p99[b:b + 3]).any() else None
              for b in first]
    par = [x["parallelism"] for x in rows]
    reaction = []
    for k, b in enumerate(first):
        want_up = sizes[steps_at[k]] > sizes[steps_at[k] - 1]
        hit = next((j for j in range(b, len(rows)) if (par[j] > par[b - 1] if want_up
                                                        else par[j] < par[b - 1])), None)
        pub = r["published"][steps_at[k]][1] if steps_at[k] < len(r["published"]) else None
        recs = [x for x in r["reconfigurations"] if x["after_batch"] >= b - 1]
        secs = (recs[0]["at_ms"] / 1e3 - pub) if (recs and pub and hit is not None) else None
        reaction.append(None if hit is None else {"batches": hit - b, "seconds": secs})
    t = np.array([x["time_ms"] for x in rows]) / 1e3
    wall = np.diff(t, prepend=t[0] - args.trigger)
    return {
        "run": r["name"], "batches": len(rows), "rows": int(sum(x["input_rows"] for x in rows)),
        "p99_latency_ms_per_phase": phases, "p99_latency_ms_around_steps": around,
        "reaction": reaction,
        "switch_ms": [round(x["switch_ms"], 3) for x in r["reconfigurations"]],
        "switch_request_ms": [round(x["request_ms"], 2) for x in r["reconfigurations"]],
        "causes": [x["cause"] for x in r["reconfigurations"]],
        "busy_core_s": float(sum(sum(x["busy_ms"]) for x in rows) / 1e3),
        "allocated_core_s": float(np.sum(np.array(par) * wall)),
        "engine_cpu_s": r["engine_cpu_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--low", type=int, default=5_000)
    ap.add_argument("--high", type=int, default=150_000)
    ap.add_argument("--phase", type=int, default=30, help="files (= trigger intervals) a step")
    ap.add_argument("--trigger", type=float, default=1.0, help="seconds between files/triggers")
    ap.add_argument("--max", type=int, default=2, help="max parallelism (the static max run's)")
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--runs", default="static1,staticmax,elastic")
    ap.add_argument("--plots", help="save each run's figures (JSON) and plot (PNG) here")
    ap.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = ap.parse_args()
    sizes = [int(n * args.trigger) for n in steps(args.low, args.high, args.phase, args.phase,
                                                  args.phase)]
    with bench_run("stretch-bench-elastic-") as bench:
        work = bench.path
        spark = bench.session(spark_stretch.session(app_name="spark-stretch elastic bench"))
        summaries = []
        for name in args.runs.split(","):
            r = run(spark, name, sizes, args, work)
            summaries.append(summarize(r, args))
            if args.plots:
                from spark_stretch.plot import plot_metrics

                d = Path(args.plots)
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{name}.json").write_text(json.dumps(r, default=str))
                plot_metrics({"per_batch": r["per_batch"]}, d / f"{name}.png",
                             title=f"{name}: {args.low:,} -> {args.high:,} -> {args.low:,} "
                                   "events/s")
            print(json.dumps(summaries[-1]) if args.json else _line(summaries[-1]), flush=True)


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _reaction(x) -> str:
    if x is None:
        return "-"
    secs = "-" if x["seconds"] is None else f"{x['seconds']:.1f} s"
    return f"{x['batches']} batches / {secs}"


def _line(s: dict) -> str:
    react = ", ".join(_reaction(x) for x in s["reaction"])
    return (f"{s['run']:>10}: {s['batches']} batches, {s['rows']:,} rows; p99 latency per phase "
            f"{' / '.join(_ms(v) for v in s['p99_latency_ms_per_phase'])} ms, around steps "
            f"{' / '.join(_ms(v) for v in s['p99_latency_ms_around_steps'])} ms; reaction "
            f"{react or '-'}; switches {s['causes']} {s['switch_ms']} ms; cores: busy "
            f"{s['busy_core_s']:.1f}, allocated {s['allocated_core_s']:.1f}, engine CPU "
            f"{s['engine_cpu_s']:.1f} core-s")


if __name__ == "__main__":
    main()
