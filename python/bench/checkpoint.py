"""Per-batch checkpoint overhead of the host engine at 10 thousand and 1 million live windows.

    python python/bench/checkpoint.py [--windows 10000,1000000] [--changed 0.01] [--json]

For each state size, the engine-side runtime of ``stretchAggregate`` (``AggregateRuntime``, no Spark)
is given one batch of that many keys, then batches that touch a fraction ``--changed`` of the keys
(the engine processes a batch's tuples when the next watermark passes them, so batch 1 creates the
live windows, one per key, and later batches update some). Each batch runs twice: on a runtime without a checkpoint
directory (the baseline) and on one with it, and the results are checked equal. Reported per
batch: step time without and with the checkpoint (the synchronous part: the snapshot copy), the
background write time (overlapped with Spark's output write in a real query), the checkpoint kind
(full / delta), buckets written and bytes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from spark_stretch.host.aggregate import AggregateRuntime
from workdir import bench_run
from spark_stretch.protocol.specs import AggregateSpec, Checkpointing


class _Receiver:
    def offer(self, stream, table):
        pass


def _spec(state_dir, buckets):
    # a checkpoint after every batch (interval 1), to measure each one
    return AggregateSpec(parallelism=2, max_parallelism=2, buckets=buckets,
                         window_us=3_600_000_000, slide_us=3_600_000_000, delay_ms=0,
                         ts_column="ts", key_column="k", key_kind="scalar", key_type="long",
                         aggs=[("count", None)],
                         checkpoint=Checkpointing(state_dir=state_dir, interval=1))


def _batch(keys, t_ms):
    return pa.table({"ts": pa.array(np.full(len(keys), t_ms * 1000), pa.timestamp("us", "UTC")),
                     "k": pa.array(keys, pa.int64())})


def run(windows: int, changed: float, batches: int, buckets: int, work: Path) -> dict:
    plain = AggregateRuntime("plain", _spec(None, buckets), _Receiver())
    ck = AggregateRuntime("ck", _spec(str(work / f"state-{windows}"), buckets), _Receiver())
    rng = np.random.default_rng(7)
    rows = []
    for b in range(batches):
        keys = np.arange(windows) if b == 0 else rng.choice(windows, max(1, int(windows * changed)),
                                                            replace=False)
        t = 1000 + b  # one hour windows: nothing is emitted, the state only grows and changes
        for rt, name in ((plain, "plain"), (ck, "ck")):
            rt.ingest(f"in:{b}", "j", _batch(keys, t))
            t0 = time.perf_counter()
            reply = rt.step(b)
            rows.append((b, name, time.perf_counter() - t0, reply.rows))
        stats = ck.wait_saved().to_dict()
        plain_s = rows[-2][2]
        ck_s = rows[-1][2]
        rows[-1] = (b, "ck", ck_s, rows[-1][3], stats)
        rows[-2] = (b, "plain", plain_s, rows[-2][3])
    assert plain.engines[0].live_windows() == ck.engines[0].live_windows() == windows
    a = plain.engines[0].state.bucket_rows()
    c = ck.engines[0].state.bucket_rows()
    assert sorted(zip(a[0].tolist(), a[2][:, 0].tolist())) == \
        sorted(zip(c[0].tolist(), c[2][:, 0].tolist())), "checkpointed run differs"
    out = []
    for b in range(batches):
        p = next(r for r in rows if r[0] == b and r[1] == "plain")
        k = next(r for r in rows if r[0] == b and r[1] == "ck")
        st = k[4]
        out.append({"batch": b, "kind": st["kind"], "buckets": st["buckets"], "bytes": st["bytes"],
                    "step_ms": p[2] * 1e3, "step_ckpt_ms": k[2] * 1e3,
                    "snapshot_ms": st["snapshot_ms"], "write_ms": st["write_ms"]})
    plain.close()
    ck.close()
    return {"windows": windows, "changed": changed, "buckets": buckets, "batches": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", default="10000,1000000")
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--buckets", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with bench_run("stretch-bench-ckpt-") as bench:
        work = bench.path
        run(1000, args.changed, 3, args.buckets, work / "warm-up")  # compiles the kernels
        report = [run(int(w), args.changed, args.batches, args.buckets, work)
                  for w in args.windows.split(",")]
    if args.json:
        print(json.dumps(report))
        return
    print(f"{'windows':>9} {'batch':>5} {'kind':>5} {'buckets':>7} {'MB':>7} {'step ms':>8} "
          f"{'+ckpt ms':>8} {'snap ms':>8} {'write ms':>8}")
    for r in report:
        for b in r["batches"]:
            print(f"{r['windows']:>9,} {b['batch']:>5} {b['kind']:>5} {b['buckets']:>7} "
                  f"{b['bytes'] / 1e6:>7.2f} {b['step_ms']:>8.1f} {b['step_ckpt_ms']:>8.1f} "
                  f"{b['snapshot_ms']:>8.1f} {b['write_ms']:>8.1f}")


if __name__ == "__main__":
    main()
