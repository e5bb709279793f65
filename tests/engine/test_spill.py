"""State past the engine's memory budget (engine/spill.py): tables in files on local disk."""
import os
import tracemalloc

import numpy as np
import pytest

from spark_stretch.engine import Engine, SNEngine, state
from spark_stretch.engine.snapshot import MAGIC_5, loads, map_file
from spark_stretch.engine.spill import Spill
from spark_stretch.ops import aggregate_many

AGGS = [("count", None, "i", None), ("sum", "v", "i", None), ("max", "x", "f", None)]


class Watched(Spill):
    """A budget that records the table pages the engine held each time it dropped them."""

    def __init__(self, budget, directory):
        super().__init__(budget, directory)
        self.held, self.trims = [], 0

    def trim(self, *arrays):
        self.trims += 1
        if self.trims % 7 == 1:  # (a sample: reading /proc/self/smaps takes a millisecond)
            self.held.append(sum(self.resident(a) for a in arrays))
        super().trim(*arrays)


def _batches(n_batches=6, rows=40_000, keys=60_000, seed=11):
    rng = np.random.default_rng(seed)
    for b in range(n_batches):
        ts = np.sort(rng.integers(b * 100, b * 100 + 150, rows))
        yield {"ts": ts, "k": rng.integers(0, keys, rows), "v": rng.integers(-50, 50, rows),
               "x": rng.normal(size=rows)}


def _run(eng, batches, restore_at=None, restore=None):
    """Every batch's output rows (as sorted tuples); at ``restore_at`` the engine is snapshotted,
    closed and restored with ``restore`` (a function of the snapshot)."""
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rows = []
    try:
        for b, cols in enumerate(batches):
            eng.esg_in.add(cols, 0)
            eng.esg_in.advance_watermark(b * 100)
            eng.drain()
            out = eng.read_output(decode=False)[0]
            rows += list(zip(out["key"].tolist(), out["window_start"].tolist(),
                             out["_0"].tolist(), out["_1"].tolist(), out["_2"].tolist()))
            if b == restore_at:
                snap = eng.snapshot()
                eng.close()
                eng = restore(snap)
        eng.esg_in.advance_watermark(10 ** 9)
        eng.drain()
        out = eng.read_output(decode=False)[0]
        rows += list(zip(out["key"].tolist(), out["window_start"].tolist(),
                         out["_0"].tolist(), out["_1"].tolist(), out["_2"].tolist()))
        return sorted(rows), eng
    finally:
        eng.close()


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_state_past_the_budget_gives_the_same_rows(engine_cls, tmp_path):
    """Tables several times a 256 KB budget live in files, and every batch gives the rows an
    engine without a budget gives (windows closing as event time goes, out-of-order tuples),
    across a snapshot and a restore under the budget; no file is left in the directory (each
    is unlinked once mapped)."""
    op = aggregate_many(AGGS, key="k", WS=100)
    want, _ = _run(engine_cls(op, m=2, n=2, n_buckets=256), _batches(6, 12_000, 80_000))
    spill = Spill(256 << 10, str(tmp_path))
    eng = engine_cls(op, m=2, n=2, n_buckets=256, spill=spill)
    got, last = _run(eng, _batches(6, 12_000, 80_000), restore_at=2,
                     restore=lambda snap: engine_cls.restore(op, snap, spill=spill))
    assert got == want and len(want) > 10_000
    assert all(st.spilled() for st in last._states())
    assert sum(st.rec.nbytes + st.acc_f.nbytes for st in last._states()) > 2.5 * spill.budget
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # (2 minutes)
def test_pages_held_stay_within_the_budget(tmp_path):
    """State more than five times a 5 MB budget: between two drops the engine held at most
    the budget of the tables' pages (sampled), through growth, emission, a snapshot and a
    restore, with two instances applying tuples at once (each within its share); the rows are
    an unbudgeted engine's."""
    op = aggregate_many(AGGS, key="k", WS=100)
    batches = dict(n_batches=4, rows=400_000, keys=2_000_000)
    want, _ = _run(Engine(op, m=2, n=2, n_buckets=4096), _batches(**batches))
    spill = Watched(5 << 20, str(tmp_path))
    got, last = _run(Engine(op, m=2, n=2, n_buckets=4096, spill=spill), _batches(**batches),
                     restore_at=1, restore=lambda snap: Engine.restore(op, snap, spill=spill))
    assert got == want
    assert last.state.rec.nbytes + last.state.acc_f.nbytes > 5 * spill.budget
    assert len(spill.held) > 100 and max(spill.held) <= spill.budget, max(spill.held)


def test_a_state_within_the_budget_stays_in_memory(tmp_path):
    """Under a budget it never reaches, the tables are plain arrays: nothing in files."""
    op = aggregate_many(AGGS, key="k", WS=100)
    spill = Watched(1 << 30, str(tmp_path))
    got, last = _run(Engine(op, m=2, n=2, n_buckets=1024, spill=spill), _batches(2, 2000, 500))
    assert len(got) > 0 and not last.state.spilled() and max(spill.held, default=0) == 0
    assert os.listdir(tmp_path) == []
    assert last.state.memory() == {"memory": last.state.nbytes(), "disk": 0}


def test_memory_and_disk_bytes_of_a_spilled_state(tmp_path):
    """``memory()``: the pages held now (none right after a drop), the files' bytes on disk."""
    op = aggregate_many(AGGS, key="k", WS=100)
    eng = Engine(op, m=1, n=1, n_buckets=1024, spill=Spill(256 << 10, str(tmp_path)))
    try:
        eng.esg_in.add_sources([0], ordered=False, watermark=0)
        eng.esg_in.add(next(_batches(1)), 0)
        eng.esg_in.advance_watermark(0)
        eng.drain()
        st = eng.state
        assert st.spilled()
        m = st.memory()
        assert m["disk"] == st.rec.nbytes + st.acc_f.nbytes and m["memory"] <= st.pool.nbytes
        st.rec[:, :, 0].sum()  # (touch every page again)
        assert st.memory()["memory"] >= st.rec.nbytes // 2
    finally:
        eng.close()


def _step(eng, cols, b, rows):
    eng.esg_in.add(dict(cols), 0)
    eng.esg_in.advance_watermark(b * 100)
    eng.drain()
    out = eng.read_output(decode=False)[0]
    rows += list(zip(out["key"].tolist(), out["window_start"].tolist(), out["_0"].tolist(),
                     out["_1"].tolist(), out["_2"].tolist()))


def _traced(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_a_checkpoint_written_at_once_never_holds_the_windows_whole(engine_cls, tmp_path,
                                                                   monkeypatch):
    """``snapshot(lazy=True)``, as the host writes its checkpoints: the live windows are copied
    a chunk of buckets at a time as the blob is written, so writing it allocates a fraction of
    what an eager snapshot copies (traced); restored from the files, a full one and a delta on
    top, the engine goes on as one that never stopped. A blob of the previous format
    (``STRETCH-SNAP-5``, no gathered arrays) still reads."""
    op = aggregate_many(AGGS, key="k", WS=1000)  # (every window live until the end)
    monkeypatch.setattr(state, "GATHER_BYTES", 1 << 20)  # (a chunk well below the windows')
    batches = list(_batches(5, 100_000, 1_000_000))
    want, _ = _run(engine_cls(op, m=2, n=2, n_buckets=4096), iter(batches))
    eng = engine_cls(op, m=2, n=2, n_buckets=4096)
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    got = []
    try:
        for b in (0, 1, 2):
            _step(eng, batches[b], b, got)
        assert eng.live_windows() > 150_000
        eager_peak = _traced(lambda: eng.snapshot(clear_dirty=False))
        eager = eng.snapshot(clear_dirty=False)

        def write(name, **kw):
            with open(tmp_path / name, "wb") as f:
                eng.snapshot(lazy=True, **kw).write_to(f)

        lazy_peak = _traced(lambda: write("full.snap"))
        assert lazy_peak * 3 < eager_peak, (lazy_peak, eager_peak)
        _step(eng, batches[3], 3, got)
        write("delta.snap", delta=True)
    finally:
        eng.close()
    raw = bytes(eager)  # (the same snapshot in the previous format: its magic, no gathered)
    v5 = MAGIC_5 + raw[len(MAGIC_5):-8]
    assert loads(v5)["state"].keys() == loads(raw)["state"].keys()
    eng = engine_cls.restore(op, map_file(tmp_path / "full.snap"),
                             deltas=[map_file(tmp_path / "delta.snap")])
    try:
        _step(eng, batches[4], 4, got)
        _step(eng, {k: v[:0] for k, v in batches[4].items()}, 10 ** 7, got)  # (all closed)
    finally:
        eng.close()
    assert sorted(got) == want and len(want) > 300_000
