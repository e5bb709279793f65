"""The host's aggregation runtime in process: a batch applied in slices (``slice_rows``) gives
the windows a sequential reference computes, and the slices are really taken."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from spark_stretch.host import aggregations
from spark_stretch.host.aggregate import AggregateRuntime
from spark_stretch.protocol.specs import AggregateSpec, Checkpointing

WINDOW_US = 10_000_000


class _Kept:
    """A receiver that keeps what the runtime offers."""

    def __init__(self):
        self.out = {}

    def offer(self, stream, table):
        if table is not None:
            self.out[stream] = table


def _batches(seed=3, n=5_000, batches=3):
    """Three batches of bigint users, each 20 s of event time after the last (no row late: the
    watermark has no delay); a last row closing every window."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(batches):
        ts = (b * 20 + rng.integers(0, 20, n)) * 1_000_000
        out.append(pa.table({"ts": pa.array(ts, pa.timestamp("us", "UTC")),
                             "user": rng.integers(0, 900, n), "x": rng.integers(-50, 1_000, n)}))
    out.append(pa.table({"ts": pa.array([10_000 * 1_000_000], pa.timestamp("us", "UTC")),
                         "user": pa.array([0], pa.int64()), "x": pa.array([0], pa.int64())}))
    return out


def _run(tmp_path, batches, monkeypatch):
    spec = AggregateSpec(ts_column="ts", delay_ms=0, key_kind="scalar", key_column="user",
                         key_type="long", window_us=WINDOW_US, slide_us=WINDOW_US,
                         aggs=[("count", None), ("sum", "x"), ("max", "x")],
                         value_types={"x": "long"}, parallelism=2, max_parallelism=2,
                         buckets=64, checkpoint=Checkpointing(state_dir=str(tmp_path)))
    kept = _Kept()
    rt = AggregateRuntime("q", spec, kept)
    try:
        sliced = aggregations.slice_rows(spec, rt.engines)
        eng, sizes = rt.engines[0], []  # (the rows of each segment the instances apply)
        apply = eng._process_segment
        monkeypatch.setattr(eng, "_process_segment", lambda seg: (sizes.append(len(seg)),
                                                                  apply(seg))[1])
        for b, t in enumerate(batches + [None]):  # (None: Spark's no-data batch, which evicts)
            if t is not None:
                rt.ingest(f"in:{b}", "j", t)
            reply = rt.step(b)
            assert reply.rows == kept.out[reply.stream].num_rows
        rows = pa.concat_tables([kept.out[f"q:out:{b}"] for b in range(len(batches) + 1)])
    finally:
        rt.close()
    return rows, sliced, max(sizes)


def _reference(batches):
    """The same windows from pandas over every row but the closing one."""
    t = pa.concat_tables(batches[:-1])
    us = pc.cast(t.column("ts"), pa.int64()).to_numpy()
    df = pd.DataFrame({"start": us - us % WINDOW_US, "user": t.column("user").to_numpy(),
                       "x": t.column("x").to_numpy()})
    g = df.groupby(["start", "user"]).x.agg(["count", "sum", "max"]).reset_index()
    return sorted(map(tuple, g[["start", "user", "count", "sum", "max"]].to_numpy().tolist()))


def _windows(rows):
    starts = pc.cast(rows.column(rows.schema.names[0]).combine_chunks().field("start"),
                             pa.int64()).to_pylist()
    cols = [rows.column(c).to_pylist() for c in rows.schema.names[1:5]]
    return sorted(zip(starts, *cols))


def test_a_batch_applied_in_slices_gives_the_reference_windows(tmp_path, monkeypatch):
    batches = _batches()
    monkeypatch.setattr(aggregations, "SLICE_ROWS", 1_000)
    rows, sliced, largest = _run(tmp_path / "sliced", batches, monkeypatch)
    assert sliced == 1_000 and largest == 1_000  # (5,000-row batches, applied 1,000 at a time)
    assert _windows(rows) == _reference(batches)
    monkeypatch.setattr(aggregations, "SLICE_ROWS", 10_000)
    whole, _, largest = _run(tmp_path / "whole", batches, monkeypatch)
    assert largest == 5_000 and _windows(whole) == _windows(rows)
