"""Runtime: setup/reconfigure/drain, epochs without state copies, errors, snapshot/restore, modes."""
import re
import time

import numpy as np
import pytest
from numba import njit

from spark_stretch.engine import (Engine, EngineError, JoinEngine, ListColumn, Operator, SNEngine,
                                  reconfigure, setup)
from spark_stretch.engine import runtime
from spark_stretch.engine.reference import ref_aggregate, reference_run
from spark_stretch.engine.snapshot import Blob, loads
from spark_stretch.ops import aggregate, aggregate_many, paircount, wordcount
from spark_stretch.ops.join import hedge_join
from spark_stretch.testing.engine import batch_to_rows, rows_to_batch, run_engine, same_rows


def tweets(n, t0=0, seed=0, vocab=50):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 8, n)
    off = np.zeros(n + 1, np.int64)
    off[1:] = np.cumsum(lens)
    return {"ts": np.sort(rng.integers(t0, t0 + 100, n)), "words": ListColumn(off, rng.integers(0, vocab, off[-1]))}


def test_setup_returns_esgs_and_pools_n_minus_m_instances():
    esg_in, esg_out = setup(wordcount(WS=10), m=2, n=4, n_buckets=64)
    eng = esg_out.engine
    assert eng is esg_in.engine and eng.active == [0, 1] and eng.pool == [2, 3]
    assert esg_in.readers() == [0, 1] and esg_out.sources() == [0, 1]
    assert reconfigure(esg_in, m=3) == 1
    eng.drain()
    assert eng.active == [0, 1, 2] and esg_in.readers() == [0, 1, 2] and esg_out.sources() == [0, 1, 2]
    reconfigure(esg_out, instances=[3])
    eng.drain()
    assert eng.active == [3] and eng.pool == [0, 1, 2] and esg_in.readers() == [3]


@pytest.mark.parametrize("m,n,msg", [(3, 2, "m=3 > n=2: initial parallelism m must not exceed max parallelism n"),
                                     (0, 2, "m=0; parallelism must be a positive int"),
                                     (1, 2.0, "n=2.0; parallelism must be a positive int")])
def test_bad_parallelism(m, n, msg):
    with pytest.raises(EngineError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Engine(wordcount(WS=10), m=m, n=n)


def test_bad_reconfigurations_are_rejected_and_the_engine_stays_usable():
    eng = Engine(wordcount(WS=10), 1, 2, n_buckets=8)
    eng.esg_in.add_sources([0], ordered=False)
    with pytest.raises(EngineError, match="owner_map misses bucket 2"):
        eng.reconfigure(instances=[0, 1], owner_map=[0, 1, 5, 0, 1, 0, 1, 0])
    with pytest.raises(EngineError, match="owner_map misses bucket 0: its owner 1"):
        eng.reconfigure(instances=[0], owner_map=[1] * 8)
    with pytest.raises(EngineError, match=r"instances \[2\] are not in range\(n=2\)"):
        eng.reconfigure(instances=[0, 2])
    with pytest.raises(EngineError, match="m=3 > n=2"):
        eng.reconfigure(m=3)
    eng.esg_in.add(tweets(20), 0)
    eng.esg_in.advance_watermark(200)
    eng.drain()
    out, wm = eng.read_output()
    assert wm == 200 and out["count"].sum() == len(tweets(20)["words"].values)


def test_key_function_of_the_wrong_type_is_rejected_at_add():
    eng = Engine(aggregate("count", key="k", WS=10), 1, 1, n_buckets=8)
    eng.esg_in.add_sources([0], ordered=False)
    with pytest.raises(EngineError, match="key column 'k' has dtype float64; keys must be int ids or strings"):
        eng.esg_in.add({"ts": np.array([1]), "k": np.array([1.5])}, 0)
    wc = Engine(wordcount(WS=10), 1, 1)
    wc.esg_in.add_sources([0], ordered=False)
    with pytest.raises(EngineError, match="keys column 'words' has type int64; keys= needs a list column"):
        wc.esg_in.add({"ts": np.array([1]), "words": np.array([1])}, 0)
    eng.esg_in.add({"ts": np.array([1]), "k": np.array(["a"], object)}, 0)  # strings are fine (interned)
    eng.esg_in.advance_watermark(10)
    eng.drain()
    assert eng.read_output()[0]["count"].tolist() == [1]


def test_user_key_function_returning_a_wrong_type_gives_a_clear_error_and_nothing_is_lost():
    @njit
    def bad_mk(cols, row, out):
        return 1.5  # not an int count

    @njit
    def mk(cols, row, out):
        out[0] = cols[0][row]
        return 1

    bad = Operator(WA=10, WS=10, f_MK=(bad_mk,), S=(("n", "i"),), columns=((("k", "int64"),),))
    eng = Engine(bad, 1, 1, n_buckets=8)
    eng.esg_in.add_sources([0], ordered=False)
    eng.esg_in.add({"ts": np.array([1]), "k": np.array([3])}, 0)
    eng.esg_in.advance_watermark(10)
    with pytest.raises(EngineError, match="f_MK of stream 0 of operator O\\+ returns float64; it must return the int number"):
        eng.drain()
    assert len(eng._backlog) == 1


def test_a_user_operator_kernel_names_none_of_the_cached_built_in_functions():
    # numba names a compiled function by its qualified name and a per-process counter, and a
    # built-in kernel loaded from the disk cache brings its callees' names from the process that
    # compiled it. A user operator's copy of the kernel bodies under the built-in names could
    # take the place of a cached built-in callee: seen once, a built-in aggregation then called
    # a user operator's window firing and emitted nothing.
    @njit
    def mk(cols, row, out):
        out[0] = cols[0][row]
        return 1

    @njit
    def up(ai, af, cols, row, key, oi, of):
        ai[0] += 1
        return 0

    @njit
    def out(ai, af, key, l, oi, of):
        oi[0, 0] = ai[0]
        return 1

    op = Operator(WA=10, WS=10, f_MK=(mk,), f_U=(up,), f_O=out, S=(("n", "i"),),
                  columns=((("k", "int64"),),))
    eng = Engine(op, 1, 1, n_buckets=8)
    eng.esg_in.add_sources([0], ordered=False)
    eng.esg_in.add({"ts": np.array([1, 2]), "k": np.array([3, 3])}, 0)
    eng.esg_in.advance_watermark(20)
    eng.drain()
    assert eng.read_output()[0]["n"].tolist() == [2]  # it ran: its kernels are compiled
    names = set()
    for kernel in op.kernels():
        for ir in kernel.inspect_llvm().values():
            names |= set(re.findall(r"define [^@]*@\"?([^\"(\s]+)", ir))
    bodies = [n for n in names if re.search(r"_(agg_kernel|fire_bucket|route)_py", n)]
    assert bodies and all("__specialized" in n for n in bodies), bodies


def test_epoch_switch_copies_no_state_and_costs_o_of_b():
    eng = Engine(wordcount(WS=1000), 2, 2, n_buckets=256)
    eng.esg_in.add_sources([0], ordered=False)
    eng.esg_in.add(tweets(2000, vocab=5000), 0)
    eng.esg_in.advance_watermark(150)
    eng.drain()
    live = eng.live_windows()
    assert live > 1000
    arrays = {k: id(v) for k, v in eng.state.arrays().items()}
    for i in range(20):
        eng.reconfigure(instances=[i % 2], owner_map=np.full(256, i % 2))
        eng.drain()
    assert {k: id(v) for k, v in eng.state.arrays().items()} == arrays  # same buffers: nothing copied
    assert eng.live_windows() == live
    m = eng.metrics()
    assert m["epoch_switches"] == 20 and m["state_bytes_copied"] == 0 and m["last_switch_ms"] < 5


def test_driven_mode_fixed_overhead_is_well_under_a_millisecond():
    eng = Engine(wordcount(WS=10), 2, 2, n_buckets=1024)
    eng.esg_in.add_sources([0], ordered=False)
    one = tweets(1)
    eng.esg_in.add(one, 0)
    eng.esg_in.advance_watermark(200)
    eng.drain()
    eng.read_output()
    times = []
    for i in range(200):
        t0 = time.perf_counter()
        eng.esg_in.add({"ts": np.array([300 + 10 * i]), "words": ListColumn([0, 2], np.array([1, 2]))}, 0)
        eng.esg_in.advance_watermark(300 + 10 * i)
        eng.drain()
        eng.read_output()
        times.append(time.perf_counter() - t0)
    assert np.median(times) < 1e-3, f"median add+watermark+drain+read {np.median(times) * 1e3:.3f} ms"


def _script(seed, steps=30):
    rng = np.random.default_rng(seed)
    script = [("sources", [0, 1])]
    t = 0
    for step in range(steps):
        for s in (0, 1):
            rows = [{"ts": t + int(rng.integers(0, 20)), "words": rng.integers(0, 12, rng.integers(0, 7)).tolist(),
                     "v": float(rng.integers(-9, 9))} for _ in range(6)]
            script.append(("add", s, rows))
        t += 7
        script.append(("wm", t))
        if step % 4 == 1:
            script.append(("reconf", {"m": int(rng.integers(1, 4))}))
        if step % 6 == 3:
            script.append(("reconf", {"instances": [0, 2], "owner_map": rng.choice([0, 2], 64)}))
    return script


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_wordcount_paircount_match_reference_under_reconfigurations(engine_cls):
    script = _script(1)
    cases = [(wordcount(WS=10, WA=5), ref_aggregate("count", keys="words", WS=10, WA=5)),
             (paircount(B=2, WS=10), ref_aggregate("count", keys="words", pairs=True, B=2, WS=10)),
             (paircount(WS=14, WA=7), ref_aggregate("count", keys="words", pairs=True, WS=14, WA=7))]
    for op, ref in cases:
        got, eng = run_engine(op, script, [{"words": "list", "v": np.float64}], m=2, n=3, engine_cls=engine_cls,
                              inline_rows=0)
        same_rows(got, reference_run(ref, script), ["count"])
        assert eng.metrics()["epoch_switches"] > 5


def test_snapshot_restore_continue_equals_uninterrupted(tmp_path):
    script = _script(2, steps=24)
    cols = [{"words": "list", "v": np.float64}]
    op = aggregate("sum", keys="words", value="v", WS=10, WA=5)
    want, _ = run_engine(op, script, cols, m=2, n=3)
    cut = len(script) // 2
    first, eng = _run_partial(op, script[:cut], cols)
    blob = eng.snapshot(tmp_path / "snap")
    assert eng.metrics()["dirty_buckets"] == 0  # cleared by the snapshot
    eng2 = Engine.restore(op, tmp_path / "snap")
    eng3 = Engine.restore(op, blob)
    for e in (eng2, eng3):
        e.esg_out.add_readers(["driver"])
        rest = _continue(e, script[cut:], cols)
        assert first + rest == want


def _run_partial(op, script, cols):
    eng = Engine(op, 2, 3, n_buckets=64)
    rows = _continue(eng, script, cols)
    return rows, eng


def _continue(eng, script, cols):
    for act in script:
        if act[0] == "sources":
            eng.esg_in.add_sources(act[1], ordered=False)
        elif act[0] == "add":
            eng.esg_in.add(rows_to_batch(act[2], cols[0]), act[1])
        elif act[0] == "wm":
            eng.esg_in.advance_watermark(act[1])
            eng.drain()
        elif act[0] == "reconf":
            eng.reconfigure(**act[1])
    eng.drain()
    return batch_to_rows(eng.read_output(decode=False)[0])


def test_free_running_threads_give_the_same_output_as_driven_mode():
    script = _script(3, steps=20)
    cols = [{"words": "list", "v": np.float64}]
    op = paircount(B=3, WS=10)
    want, _ = run_engine(op, script, cols, m=2, n=3)
    eng = Engine(op, 2, 3, n_buckets=64, inline_rows=0)
    eng.start()
    try:
        for act in script:
            if act[0] == "sources":
                eng.esg_in.add_sources(act[1], ordered=False)
            elif act[0] == "add":
                eng.esg_in.add(rows_to_batch(act[2], cols[0]), act[1])
            elif act[0] == "wm":
                eng.esg_in.advance_watermark(act[1])
            elif act[0] == "reconf":
                eng.reconfigure(**act[1])
        eng.drain(timeout=60)
    finally:
        eng.stop()
    assert batch_to_rows(eng.read_output(decode=False)[0]) == want


def test_composition_esg_out_feeds_the_next_operator():
    # word count per 10, then count of (word, window) results per word over 20: a 2-operator pipeline
    a = Engine(wordcount(WS=10), 2, 2, n_buckets=32, out_reader=None)
    b = Engine(aggregate("sum", key="key", value="count", value_type="i", WS=20), 1, 2, n_buckets=32,
               esg_in=a.esg_out)
    a.esg_in.add_sources([0], ordered=False)
    tw = tweets(300, vocab=6)
    a.esg_in.add(tw, 0)
    a.esg_in.advance_watermark(120)
    a.drain()
    b.drain()
    out, wm = b.read_output()
    assert wm == 120
    words = tw["words"]
    total = {}
    for t, ws in zip(tw["ts"].tolist(), words.to_pylist()):
        end_a = (t // 10) * 10 + 10  # a's result for t's window has ts = window end
        if end_a > 120:
            continue
        lb = (end_a // 20) * 20  # ... and falls in b's window starting at lb
        for w in ws:
            total[(w, lb)] = total.get((w, lb), 0) + 1
    got = {(k, l): v for k, l, v in zip(out["key"].tolist(), out["window_start"].tolist(), out["sum"].tolist())}
    assert got == {k: v for k, v in total.items() if k[1] + 20 <= 120}
    assert (np.diff(out["ts"]) >= 0).all()


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_incremental_snapshots_restore_equals_uninterrupted(engine_cls):
    # A full snapshot, then one incremental (dirty buckets only) snapshot per segment of the
    # script; restoring base + deltas at every cut point and continuing gives the same output.
    script = _script(3, steps=30)
    cols = [{"words": "list", "v": np.float64}]
    op = aggregate("sum", keys="words", value="v", WS=10, WA=5)
    want, _ = run_engine(op, script, cols, m=2, n=3)
    cuts = [6, 12, 18, 24]
    eng = engine_cls(op, 2, 3, n_buckets=64)
    rows, blobs, start = [], [], 0
    for cut in cuts:
        rows += _continue(eng, script[start:cut], cols)
        blobs.append(eng.snapshot(delta=bool(blobs)))
        start = cut
        again = engine_cls.restore(op, blobs[0], deltas=blobs[1:])
        again.esg_out.add_readers(["driver"])
        assert rows + _continue(again, script[cut:], cols) == want


def test_incremental_snapshot_holds_only_the_changed_buckets():
    op = wordcount(WS=100)
    eng = Engine(op, 2, 2, n_buckets=1024, lateness="window")
    eng.esg_in.add_sources([0], ordered=False)
    n = 20000
    eng.esg_in.add({"ts": np.ones(n, np.int64),
                    "words": ListColumn(np.arange(n + 1), np.arange(n, dtype=np.int64))}, 0)
    eng.esg_in.advance_watermark(5)
    eng.drain()
    assert eng.live_windows() == n
    full = eng.snapshot()
    assert eng.metrics()["dirty_buckets"] == 0
    # One tuple with one word updates one window of one key: one bucket.
    eng.esg_in.add({"ts": np.array([6]), "words": ListColumn(np.array([0, 1]), np.array([7]))}, 0)
    eng.esg_in.advance_watermark(7)
    eng.drain()
    dirty = np.flatnonzero(eng.state.dirty)
    assert len(dirty) == 1
    delta = eng.snapshot(delta=True)
    part = loads(delta)["state"]["shared"]
    assert list(part["only"]) == list(dirty)
    assert set(part["b"]) == set(dirty) and len(part["b"]) == eng.state.bcount[dirty[0]]
    assert len(part["b"]) < n / 100 and len(delta) < len(full) / 10
    # Base + delta is the state now: the same windows with the same counts.
    again = Engine.restore(op, full, deltas=[delta])
    got = sorted(zip(*[a.tolist() for a in again.state.bucket_rows()[:2]],
                     again.state.bucket_rows()[2][:, 0].tolist()))
    want = sorted(zip(*[a.tolist() for a in eng.state.bucket_rows()[:2]],
                      eng.state.bucket_rows()[2][:, 0].tolist()))
    assert got == want and len(got) == n


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_stamped_aggregation_gives_each_batch_the_windows_it_changed(engine_cls):
    """Spark's update mode on the engine: a batch applied whole (release_all), the windows it
    changed read from the state (state_rows), the watermark evicting afterwards; against a
    dict of windows kept by hand, with late rows and a rescale between batches."""
    WS, WA, delay = 20, 10, 15
    op = aggregate("sum", key="k", value="v", value_type="i", WS=WS, WA=WA, stamped=True)
    eng = engine_cls(op, m=2, n=3, n_buckets=64, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(7)
    state, wm, top = {}, 0, 0
    for batch in range(8):
        ts = rng.integers(max(0, top - 40), top + 30, 40)
        k, v = rng.integers(0, 6, 40), rng.integers(-5, 10, 40)
        eng.esg_in.add({"ts": ts, "k": k, "v": v}, 0)
        eng.release_all(batch + 1)
        rec, _ = eng.state_rows(batch + 1)
        got = {(int(r[0]), int(r[1])): int(r[2]) for r in rec}
        changed = set()
        for t, key, val in zip(ts.tolist(), k.tolist(), v.tolist()):
            for l in range((t // WA) * WA, t - WS, -WA):
                if l + WS > wm:   # Spark's late rule: windows that ended by the watermark
                    state[(key, l)] = state.get((key, l), 0) + val
                    changed.add((key, l))
        assert got == {w: state[w] for w in changed}
        top = max(top, int(ts.max()))
        wm = max(wm, top - delay)
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        eng.esg_out.get_batch("driver")
        state = {w: x for w, x in state.items() if w[1] + WS > wm}
        assert {(int(r[0]), int(r[1])): int(r[2]) for r in eng.state_rows()[0]} == state
        if batch == 3:
            eng.reconfigure(m=3)
    with pytest.raises(EngineError, match="applies tuples in order"):
        Engine(aggregate("sum", key="k", value="v", WS=WS), m=1, n=1).release_all(1)


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_whole_batches_in_append_mode_emit_what_spark_emits(engine_cls, monkeypatch):
    """apply_whole_batches: tuples applied as they came (no event-time sort, none held back),
    windows fired by the watermark only; the windows emitted, with their count, sum, min and
    max, equal to a dict kept by Spark's rules (late rows, stragglers into windows still open),
    with a rescale and a checkpoint restored between batches, and a last close of more windows
    than an instance's output block holds (handed out in blocks of its rows only).
    Order-dependent aggregates (first, a double's max: NaN and -0.0) keep the event-time
    order."""
    WS, WA, delay = 20, 10, 15
    aggs = [("count", None, "i", None), ("sum", "v", "i", None), ("min", "v", "i", None),
            ("max", "v", "i", None)]
    op = aggregate_many(aggs, key="k", WS=WS, WA=WA)
    eng = engine_cls(op, m=2, n=3, n_buckets=64, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    assert eng.apply_whole_batches() and eng.applies_whole_batches
    rng = np.random.default_rng(11)
    state, emitted, got, wm, top = {}, {}, {}, 0, 0
    for batch in range(10):
        ts = rng.integers(max(0, top - 40), top + 30, 200)
        k, v = rng.integers(0, 6, 200), rng.integers(-50, 100, 200)
        eng.esg_in.add({"ts": ts, "k": k, "v": v}, 0)
        eng.release_all(0)
        for t, key, val in zip(ts.tolist(), k.tolist(), v.tolist()):
            for l in range((t // WA) * WA, t - WS, -WA):
                if l + WS > wm:
                    n, sm, mn, mx = state.get((key, l), (0, 0, val, val))
                    state[(key, l)] = (n + 1, sm + val, min(mn, val), max(mx, val))
        top = max(top, int(ts.max()))
        wm = max(wm, top - delay)
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        out = eng.esg_out.get_batch("driver")[0]
        for key, l, *vals in zip(*(out[c].tolist() for c in ("key", "window_start", "_0", "_1",
                                                            "_2", "_3"))):
            assert (key, l) not in got  # (each window once)
            got[(key, l)] = tuple(vals)
        for w in [w for w in state if w[1] + WS <= wm]:
            emitted[w] = state.pop(w)
        assert got == emitted
        if batch == 3:
            eng.reconfigure(m=3)
        if batch == 6:
            eng = engine_cls.restore(op, eng.snapshot())
            assert eng.apply_whole_batches()
    assert len(got) > 50
    monkeypatch.setattr(runtime, "OUT_CHUNK_ROWS", 1024)  # (an instance's first block: 1024)
    ts, k = np.arange(top, top + 5000), 100 + np.arange(5000) % 2500
    eng.esg_in.add({"ts": ts, "k": k, "v": k % 7}, 0)
    eng.release_all(0)
    for t, key in zip(ts.tolist(), k.tolist()):
        for l in range((t // WA) * WA, t - WS, -WA):
            n, sm, mn, mx = state.get((key, l), (0, 0, key % 7, key % 7))
            state[(key, l)] = (n + 1, sm + key % 7, min(mn, key % 7), max(mx, key % 7))
    eng.esg_in.advance_watermark(10 ** 9)
    eng.drain()
    blocks = eng.esg_out.get_batch("driver", chunks=True)[0]
    assert len(blocks) > 6 and max(len(b["ts"]) for b in blocks) <= 1024
    # (rows only: no window end, no tie columns; no engine's instances may read them)
    assert set(blocks[0]) == {"ts", "key", "window_start", "_0", "_1", "_2", "_3"}
    with pytest.raises(EngineError, match="rows only"):
        eng.esg_out.add_readers([7])
    for out in blocks:
        for key, l, *vals in zip(*(out[c].tolist() for c in ("key", "window_start", "_0", "_1",
                                                            "_2", "_3"))):
            assert (key, l) not in got
            got[(key, l)] = tuple(vals)
    emitted.update(state)
    assert got == emitted and len(state) > 9000
    empty, = eng.esg_out.get_batch("driver", chunks=True)[0]  # (nothing more: one empty block)
    assert {"key", "window_start", "_3"} <= set(empty) and len(empty["ts"]) == 0
    for other in ([("max", "v", "f", None)], [("first", "v", "i", None)]):
        plain = Engine(aggregate_many(other, key="k", WS=WS, WA=WA), m=1, n=1)
        assert not plain.apply_whole_batches() and not plain.applies_whole_batches
    join = JoinEngine(hedge_join(10), m=1, n=1)  # (not an aggregation: its own parameters)
    assert not join.apply_whole_batches() and not join.applies_whole_batches


def _spark_sessions(batches, delay):
    """Spark's session-window aggregation (sum per key), batch by batch, as its operators do
    it: rows late by the previous watermark dropped (their own session ended by it), the rest
    merged with the state's sessions in start order (a session starting at or before the
    current one's end joins it), sessions ending by the new watermark emitted and evicted."""
    state, wm, nxt, top, out = {}, 0, 0, None, []
    for ts, k, v, gap in batches:
        rows = [(t, t + g, key, x) for t, g, key, x in zip(ts, gap, k, v) if t + g > wm]
        for key in {r[2] for r in rows} | set(state):
            items = sorted(state.get(key, []) + [(t, e, x) for t, e, kk, x in rows if kk == key])
            merged = []
            for s, e, x in items:
                if merged and s <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], e), merged[-1][2] + x)
                else:
                    merged.append((s, e, x))
            state[key] = merged
        top = max(ts) if top is None else max(top, max(ts))
        wm = nxt
        done = [(key, s, e, x) for key, ss in state.items() for s, e, x in ss if e <= wm]
        out.append(sorted(done))
        state = {key: [w for w in ss if w[1] > wm] for key, ss in state.items()}
        nxt = max(nxt, top - delay)
    return out


@pytest.mark.parametrize("m", [1, 2])
def test_session_windows_match_spark_sessions_batch_by_batch(m):
    rng = np.random.default_rng(11)
    delay, batches, top = 25, [], 0
    for _ in range(10):
        ts = rng.integers(max(0, top - 50), top + 40, 30)
        top = max(top, int(ts.max()))
        batches.append((ts.tolist(), rng.integers(0, 4, 30).tolist(), rng.integers(1, 9, 30).tolist(),
                        rng.integers(1, 12, 30).tolist()))
    want = _spark_sessions(batches, delay)
    op = aggregate("sum", key="k", value="v", value_type="i", session_end="end")
    eng = Engine(op, m=m, n=2, n_buckets=16, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    wm, nxt, top = 0, 0, 0
    for n, (ts, k, v, gap) in enumerate(batches):
        ts = np.array(ts)
        eng.esg_in.add({"ts": ts, "k": np.array(k), "v": np.array(v), "end": ts + np.array(gap)}, 0)
        wm, top = nxt, max(top, int(ts.max()))
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        out, _ = eng.esg_out.get_batch("driver")
        got = sorted(zip(out["key"].tolist(), out["window_start"].tolist(), out["end"].tolist(),
                         out["sum"].tolist()))
        assert got == want[n], n
        nxt = max(nxt, top - delay)
    assert sum(map(len, want)) > 10


def _kept_sessions(batches, delay):
    """Spark's session windows in complete mode, after each batch: every session of each key
    (its rows as ``(t, v, x)``), none evicted; rows late by the previous watermark dropped."""
    state, wm, nxt, top, out = {}, 0, 0, 0, []
    for ts, k, v, x, gap in batches:
        for t, e, key, vv, xx in zip(ts, (a + b for a, b in zip(ts, gap)), k, v, x):
            if e <= wm:
                continue
            merged = []
            for s, end, rows in sorted(state.get(key, []) + [(t, e, [(t, vv, xx)])]):
                if merged and s <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end), merged[-1][2] + rows)
                else:
                    merged.append((s, end, rows))
            state[key] = merged
        out.append({(key, s, e): rows for key, ss in state.items() for s, e, rows in ss})
        top = max(top, max(ts))
        wm = nxt
        nxt = max(nxt, top - delay)
    return out


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_kept_sessions_merge_out_of_order_rows_as_spark_in_complete_mode(engine_cls, tmp_path):
    """Complete mode: rows applied as they come, in any order, joining sessions; against the
    sessions kept by hand, with late rows, bucket growth, a rescale and a restore."""
    rng = np.random.default_rng(7)
    delay, batches, top, seen = 60, [], 0, set()
    for _ in range(12):
        ts = rng.integers(top - 80, top + 120, 200)
        ts = np.array([t for t in dict.fromkeys(ts.tolist()) if t not in seen][:60])
        seen.update(ts.tolist())  # (distinct times: first/last have no ties)
        top = max(top, int(ts.max()))
        batches.append((ts.tolist(), rng.integers(0, 6, 60).tolist(), rng.integers(-9, 9, 60).tolist(),
                        (rng.integers(0, 90, 60) / 4).tolist(), rng.integers(1, 15, 60).tolist()))
    want = _kept_sessions(batches, delay)
    aggs = [("count", None, "i", None), ("sum", "v", "i", None), ("min", "v", "i", None),
            ("max", "x", "f", None), ("mean", "x", "f", None), ("first", "v", "i", None),
            ("last", "x", "f", None), ("max_by", "v", "i", "o")]
    op = aggregate_many(aggs, key="k", session_end="end", stamped=True)
    eng = engine_cls(op, m=2, n=3, n_buckets=4, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    wm, nxt, top, joins = 0, 0, 0, 0
    for n, (ts, k, v, x, gap) in enumerate(batches):
        ts = np.array(ts)
        eng.esg_in.add({"ts": ts, "k": np.array(k), "v": np.array(v), "x": np.array(x),
                        "o": -1.5 * ts, "end": ts + np.array(gap)}, 0)
        eng.release_all(n + 1)
        rec, acc = eng.state_rows()
        got = {(int(r[0]), int(r[2]), int(r[3])): (tuple(int(i) for i in r[4:]), tuple(a))
               for r, a in zip(rec, acc)}
        assert sorted(got) == sorted(want[n]), n
        for w, rows in want[n].items():
            ri, rf = got[w]
            t0, t1 = min(rows), max(rows)
            assert ri[0] == len(rows) and ri[1] == sum(r[1] for r in rows)
            assert ri[2] == min(r[1] for r in rows) and rf[3] == max(r[2] for r in rows)
            assert rf[4] / ri[4] == pytest.approx(sum(r[2] for r in rows) / len(rows))  # (sum, n)
            assert ri[5] == t0[1] and rf[6] == t1[2]
            assert ri[7] == t0[1]  # (ordered by -1.5 t)
            joins += len(rows) > 1
        top = max(top, int(ts.max()))
        wm, nxt = nxt, max(nxt, top - delay)
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        assert not len(eng.esg_out.get_batch("driver")[0]["ts"])  # (none emitted)
        if n == 4:
            eng.reconfigure(m=3)
        if n == 7:
            eng = engine_cls.restore(op, eng.snapshot())
    assert joins > 20 and eng.metrics()["grows"] > 0
    assert eng.esg_in.late_dropped > 0


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
@pytest.mark.parametrize("sessions", [False, True])
def test_count_any_keeps_the_count_and_the_flags_set_in_one_word(engine_cls, sessions):
    """count_any: a window's tuples counted in bits 0-47 of its word, bits 48-62 the or of the
    tuples' flag masks (two flags here), in a record a word narrower than a count beside a sum
    of flags; against the windows kept by hand (sliding windows, or sessions merging in
    complete mode), with windows whose flags are all 0, a rescale and a restore."""
    rng = np.random.default_rng(3)
    delay, batches, top, seen = 60, [], 0, set()
    for _ in range(10):
        ts = rng.integers(top - 80, top + 120, 200)
        ts = np.array([t for t in dict.fromkeys(ts.tolist()) if t not in seen][:60])
        seen.update(ts.tolist())
        top = max(top, int(ts.max()))
        masks = (rng.random(60) < 0.3) + 2 * (rng.random(60) < 0.2)
        batches.append((ts.tolist(), rng.integers(0, 8, 60).tolist(), masks.tolist(), [0] * 60,
                        rng.integers(1, 15, 60).tolist()))
    aggs = [("count_any", "f", "i", None), ("sum", "f", "i", None)]
    WS, WA = 20, 10
    if sessions:
        op = aggregate_many(aggs, key="k", session_end="end", stamped=True)
        want = _kept_sessions(batches, delay)
    else:
        op = aggregate_many(aggs, key="k", WS=WS, WA=WA)
    assert op.n_int == (2 if sessions else 0) + 2  # (a session's start and end, the aggregates)
    eng = engine_cls(op, m=2, n=3, n_buckets=4, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    assert sessions or eng.apply_whole_batches()

    def word(rows):  # (rows' flag masks: the count, and their or above it)
        return len(rows) | (np.bitwise_or.reduce(rows) << 48)

    wm, nxt, top, kept, masks_seen = 0, 0, 0, {}, set()
    for n, (ts, k, f, _, gap) in enumerate(batches):
        ts = np.array(ts)
        eng.esg_in.add({"ts": ts, "k": np.array(k), "f": np.array(f), "end": ts + np.array(gap)}, 0)
        eng.release_all(n + 1 if sessions else 0)
        if sessions:
            want_n = {(key, s): [r[1] for r in rows] for (key, s, _), rows in want[n].items()}
        else:  # (every window a row falls in that the watermark has not closed)
            for t, key, fl in zip(ts.tolist(), k, f):
                for l in range((t // WA) * WA, t - WS, -WA):
                    if l + WS > wm:
                        kept.setdefault((key, l), []).append(fl)
            want_n = {w: list(rows) for w, rows in kept.items()}
        rec, _ = eng.state_rows()
        at = 2 if sessions else 1  # (the window's start: a session's after its l)
        got = {(int(r[0]), int(r[at])): (int(r[at + 1 + sessions]), int(r[at + 2 + sessions]))
               for r in rec}
        assert sorted(got) == sorted(want_n), n
        for w, rows in want_n.items():
            assert got[w] == (word(rows), sum(rows)), w
            masks_seen.add(got[w][0] >> 48)
        top = max(top, int(ts.max()))
        wm, nxt = nxt, max(nxt, top - delay)
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        out = eng.esg_out.get_batch("driver")[0]
        if not sessions:  # (the windows the watermark closed, emitted with their word)
            closed = {w: kept.pop(w) for w in [w for w in kept if w[1] + WS <= wm]}
            emitted = dict(zip(zip(out["key"].tolist(), out["window_start"].tolist()),
                               zip(out["_0"].tolist(), out["_1"].tolist())))
            assert emitted == {w: (word(rows), sum(rows)) for w, rows in closed.items()}
        if n == 4:
            eng.reconfigure(m=3)
        if n == 7:
            eng = engine_cls.restore(op, eng.snapshot())
            assert sessions or eng.apply_whole_batches()
    assert masks_seen == {0, 1, 2, 3}


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
@pytest.mark.parametrize("fn", ["first", "last"])
@pytest.mark.parametrize("kind", ["i", "f"])
def test_first_and_last_take_the_earliest_and_latest_event_time(engine_cls, fn, kind):
    """first/last per window: the value of the tuple with the earliest (latest) timestamp among
    those whose take flag is set, ties by arrival; against a dict kept by hand, over tuples out
    of order across batches, with late rows and a rescale."""
    WS, WA, delay = 20, 10, 15
    op = aggregate(fn, key="k", value="v", value_type=kind, take="take", WS=WS, WA=WA,
                   stamped=True)
    eng = engine_cls(op, m=2, n=3, n_buckets=64, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(5)
    best, wm, top = {}, 0, 0  # window -> (timestamp, value) taken
    for batch in range(8):
        ts = rng.integers(max(0, top - 40), top + 30, 40)
        k, v, take = rng.integers(0, 5, 40), rng.integers(-50, 50, 40), rng.integers(0, 2, 40)
        eng.esg_in.add({"ts": ts, "k": k, "v": v if kind == "i" else v + 0.5, "take": take}, 0)
        eng.release_all(batch + 1)
        for t, key, val, tk in zip(ts.tolist(), k.tolist(), v.tolist(), take.tolist()):
            for l in range((t // WA) * WA, t - WS, -WA):
                if l + WS > wm and tk:
                    cur = best.get((key, l))
                    if cur is None or (t < cur[0] if fn == "first" else t >= cur[0]):
                        best[(key, l)] = (t, val)
        rec, acc = eng.state_rows()
        got = {(int(r[0]), int(r[1])): (int(r[2]) if kind == "i" else float(a[0]) - 0.5)
               for r, a in zip(rec, acc)}
        assert {w: x for w, x in got.items() if w in best} == {w: x[1] for w, x in best.items()}
        top = max(top, int(ts.max()))
        wm = max(wm, top - delay)
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        eng.esg_out.get_batch("driver")
        best = {w: x for w, x in best.items() if w[1] + WS > wm}
        if batch == 3:
            eng.reconfigure(m=3)


AGGS = [("count", None, "i", None), ("sum", "v", "i", None), ("sum", "x", "f", None),
        ("min", "v", "i", None), ("max", "x", "f", None), ("mean", "x", "f", None),
        ("first", "v", "i", "take"), ("last", "x", "f", "take"), ("last", "v", "i", None)]


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
@pytest.mark.parametrize("windows", ["sliding", "tumbling", "session", "stamped"])
def test_aggregate_many_equals_one_operator_per_aggregation(engine_cls, windows):
    """The fused operator (one record per window holding every aggregation) gives, row for row,
    what one operator per aggregation gives, over tuples out of order, late rows and a
    rescale."""
    from spark_stretch.ops import aggregate_many

    kw = {"sliding": dict(WS=20, WA=10), "tumbling": dict(WS=20),
          "session": dict(session_end="end"), "stamped": dict(WS=20, WA=10, stamped=True)}[windows]
    fused = aggregate_many(AGGS, key="k", **kw)
    singles = [aggregate(a, key="k", value=v, value_type=vt, take=tk, **kw) for a, v, vt, tk in AGGS]
    engines = [engine_cls(op, m=2, n=3, n_buckets=64, lateness="window")
               for op in [fused] + singles]
    for eng in engines:
        eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(3)
    top, seen = 0, 0
    try:
        for batch in range(8):
            ts = rng.integers(max(0, top - 30), top + 30, 50)
            cols = {"ts": ts, "k": rng.integers(0, 6, 50), "v": rng.integers(-9, 9, 50),
                    "x": rng.normal(size=50), "take": rng.integers(0, 2, 50),
                    "end": ts + rng.integers(1, 12, 50)}
            for eng in engines:
                eng.esg_in.add(dict(cols), 0)
                if windows == "stamped":
                    eng.release_all(batch + 1)
            if windows == "stamped":
                rec, acc = engines[0].state_rows(batch + 1)
                order = np.lexsort((rec[:, 1], rec[:, 0]))
                for q, eng in enumerate(engines[1:]):
                    r1, a1 = eng.state_rows(batch + 1)
                    o1 = np.lexsort((r1[:, 1], r1[:, 0]))
                    assert np.array_equal(rec[order][:, :2], r1[o1][:, :2])
                    assert np.array_equal(rec[order][:, 2 + q], r1[o1][:, 2])
                    assert np.allclose(acc[order][:, q], a1[o1][:, 0], equal_nan=True)
            top = max(top, int(ts.max()))
            for eng in engines:
                eng.esg_in.advance_watermark(top - 15)
                eng.drain()
            outs = [eng.read_output(decode=False)[0] for eng in engines]
            for q, (a, out) in enumerate(zip(AGGS, outs[1:])):
                assert np.array_equal(outs[0]["key"], out["key"])
                assert np.array_equal(outs[0]["window_start"], out["window_start"])
                name = out_name = singles[q].S[-1][0]
                assert np.array_equal(outs[0][f"_{q}"], out[out_name], equal_nan=True), (a, name)
            seen += len(outs[0]["key"])
            if batch == 3:
                for eng in engines:
                    eng.reconfigure(m=3)
        assert seen > 20
    finally:
        for eng in engines:
            eng.close()


@pytest.mark.parametrize("fn", ["max_by", "min_by"])
def test_max_by_and_min_by_take_the_last_of_ties_and_skip_nan(fn):
    """max_by/min_by per window against a dict kept by hand (Spark's rule: a new row replaces
    the kept one unless the kept ordering is strictly better; a null (NaN) ordering is skipped),
    over several batches with ties, in order within each key."""
    from spark_stretch.ops import aggregate_many

    op = aggregate_many([(fn, "v", "i", "y"), ("count", None, "i", None)], key="k", WS=20,
                        stamped=True)
    eng = Engine(op, m=2, n=2, n_buckets=16, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(9)
    best = {}
    try:
        for batch in range(5):
            ts = np.sort(rng.integers(batch * 10, batch * 10 + 10, 30))
            k, v = rng.integers(0, 3, 30), rng.integers(0, 100, 30)
            y = rng.integers(0, 4, 30).astype(float)
            y[rng.random(30) < 0.2] = np.nan
            eng.esg_in.add({"ts": ts, "k": k, "v": v, "y": y}, 0)
            eng.release_all(batch + 1)
            for t, key, val, o in zip(ts.tolist(), k.tolist(), v.tolist(), y.tolist()):
                w = (key, t // 20 * 20)
                cur = best.get(w)
                if o == o and (cur is None or (o >= cur[0] if fn == "max_by" else o <= cur[0])):
                    best[w] = (o, val)
            rec, _ = eng.state_rows()
            got = {(int(r[0]), int(r[1])): int(r[2]) for r in rec if (int(r[0]), int(r[1])) in best}
            assert got == {w: x[1] for w, x in best.items()}
    finally:
        eng.close()


def _hll_words(hashes, p):
    """Spark's HLL++ buffer words of 64-bit hashes, kept by hand (HyperLogLogPlusPlusHelper)."""
    regs = [0] * (1 << p)
    for h in hashes:
        u = h & (2 ** 64 - 1)
        rest = ((u << p) | (1 << (p - 1))) & (2 ** 64 - 1)
        regs[u >> (64 - p)] = max(regs[u >> (64 - p)], 64 - rest.bit_length() + 1)
    return [sum(r << (6 * i) for i, r in enumerate(regs[w * 10:w * 10 + 10]))
            for w in range((1 << p) // 10 + 1)]


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
@pytest.mark.parametrize("windows", ["tumbling", "session"])
def test_hll_registers_are_sparks_buffer_words(engine_cls, windows):
    """An approx_count_distinct's state (``hll<p>``, its words in the register pool) equals
    Spark's HLL++ buffer computed by hand from the same hashes (rows with a take flag of 0
    skipped), next to a count in the same record."""
    from spark_stretch.engine.errors import EngineError
    from spark_stretch.ops import aggregate_many

    p = 5
    kw = dict(WS=1000) if windows == "tumbling" else dict(session_end="end")
    op = aggregate_many([("count", None, "i", None), ("hll5", "h", "i", "take")], key="k", **kw)
    eng = engine_cls(op, m=2, n=2, n_buckets=16, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(5)
    n = 400
    h = rng.integers(-2 ** 63, 2 ** 63 - 1, n, dtype=np.int64)
    h[:50] = h[50:100]  # repeated values
    k, take = rng.integers(0, 3, n), rng.integers(0, 4, n) > 0
    ts = np.sort(rng.integers(0, 500, n))
    try:
        eng.esg_in.add({"ts": ts, "k": k, "h": h, "take": take.astype(np.int64),
                        "end": ts + 2000}, 0)
        eng.esg_in.advance_watermark(5000)
        eng.drain()
        out = eng.read_output(decode=False)[0]
        assert sorted(out["key"].tolist()) == [0, 1, 2]
        for r, key in enumerate(out["key"].tolist()):
            want = _hll_words([int(x) for x in h[(k == key) & take]], p)
            assert out["_1"][r].tolist() == want and int(out["_0"][r]) == int((k == key).sum())
    finally:
        eng.close()
    with pytest.raises(EngineError, match="run in aggregate_many"):
        aggregate("hll5", key="k", value="h", value_type="i", WS=10)


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
@pytest.mark.parametrize("windows", ["sliding", "stamped", "kept-sessions"])
def test_hll_registers_live_in_a_pool_of_rows_collected_and_grown(engine_cls, windows):
    """Two approx_count_distincts (2**14 and 2**8 registers) per window, the registers in the
    register pool: each window's words equal Spark's buffer kept by hand (sessions: merged when
    they join), over batches that create and close many windows (rows collected, the pool
    grown), a rescale and a restore from a snapshot and a delta; a window's record stays
    narrow."""
    from spark_stretch.ops import aggregate_many

    kw = {"sliding": dict(WS=20, WA=10), "stamped": dict(WS=20, WA=10, stamped=True),
          "kept-sessions": dict(session_end="end", stamped=True)}[windows]
    op = aggregate_many([("hll14", "h", "i", "take"), ("count", None, "i", None),
                         ("hll8", "h", "i", None)], key="k", **kw)
    assert op.n_int <= 6 and op.pool == ((0, 0, 1639), (2, 1639, 26))
    eng = engine_cls(op, m=2, n=3, n_buckets=8, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(17)
    rows, wm, top, checked = [], 0, 0, 0  # (every row taken: (ts, end, key, hash, take))
    try:
        for batch in range(10):
            ts = rng.integers(max(0, top - 15), top + 25, 60)
            k = rng.integers(0, 7, 60)
            h = rng.integers(-2 ** 63, 2 ** 63 - 1, 60, dtype=np.int64)
            h[:10] = rng.choice(h[10:], 10)  # repeated values
            take = rng.integers(0, 5, 60) > 0
            end = ts + rng.integers(1, 6, 60)
            eng.esg_in.add({"ts": ts, "k": k, "h": h, "take": take.astype(np.int64),
                            "end": end}, 0)
            if windows == "sliding":
                rows += [(int(t), int(e), int(x), int(y), bool(z))
                         for t, e, x, y, z in zip(ts, end, k, h, take)]
                top = max(top, int(ts.max()))
                wm = top - 10
                eng.esg_in.advance_watermark(wm)
                eng.drain()
                out = eng.read_output(decode=False)[0]
                for r, (key, l) in enumerate(zip(out["key"].tolist(), out["window_start"].tolist())):
                    mine = [x for x in rows if x[2] == key and l <= x[0] < l + 20]
                    assert out["_0"][r].tolist() == _hll_words([x[3] for x in mine if x[4]], 14)
                    assert out["_2"][r].tolist() == _hll_words([x[3] for x in mine], 8)
                    assert out["_1"][r] == len(mine)
                    checked += 1
            else:
                eng.release_all(batch + 1)
                late = [(int(t), int(e), int(x), int(y), bool(z))
                        for t, e, x, y, z in zip(ts, end, k, h, take)]
                rows += [x for x in late if (x[1] if windows == "kept-sessions" else
                                             x[0] // 10 * 10 + 20) > wm]
                rec, acc, words = eng.state_rows(words=True)
                for r, rw in enumerate(rec):
                    key = int(rw[0])
                    if windows == "kept-sessions":  # (a session's start and end in its record)
                        mine = [x for x in rows if x[2] == key and rw[2] <= x[0] and x[1] <= rw[3]]
                        count = rw[5]
                    else:
                        mine = [x for x in rows if x[2] == key and rw[1] <= x[0] < rw[1] + 20]
                        count = rw[3]
                    assert words[0][r].tolist() == _hll_words([x[3] for x in mine if x[4]], 14)
                    assert words[2][r].tolist() == _hll_words([x[3] for x in mine], 8)
                    assert count == len(mine)
                    checked += 1
                top = max(top, int(ts.max()))
                wm = max(wm, top - 10)
                eng.esg_in.advance_watermark(wm)
                eng.drain()
                eng.read_output(decode=False)
            if batch == 3:
                eng.reconfigure(m=3)
            if batch == 5:
                base = eng.snapshot()
            if batch == 6:
                eng = engine_cls.restore(op, base, deltas=[eng.snapshot(delta=True)])
        assert checked > 40 and eng.metrics()["pool_refills"] > 0
        pools = [eng.state.pool] if engine_cls is Engine else [st.pool for st in eng.states]
        assert all(p.shape[1] == 1639 + 26 for p in pools)
    finally:
        eng.close()


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
@pytest.mark.parametrize("kind", ["l", "s"])
def test_max_by_and_min_by_by_an_exact_ordering(engine_cls, kind):
    """max_by/min_by by int64 keys (apart by less than a double resolves) or by strings (their
    ranks, given again as strings are added): against dicts kept by hand, ties to the last,
    a null ordering (take flag 0) skipped, over batches with a rescale and a restore."""
    from spark_stretch.ops import aggregate_many

    aggs = [(f"max_by_{kind}", "v", "i", "ok"), ("by_key", "y", "i", None),
            (f"min_by_{kind}", "v", "i", "ok"), ("by_key", "y", "i", None),
            ("count", None, "i", None)]
    op = aggregate_many(aggs, key="k", WS=20, stamped=True)
    eng = engine_cls(op, m=2, n=3, n_buckets=16, lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    rng = np.random.default_rng(11)
    strings = []  # (interned by hand: id -> string)
    best = {}
    try:
        for batch in range(6):
            ts = np.sort(rng.integers(batch * 10, batch * 10 + 10, 40))
            k, v, ok = rng.integers(0, 3, 40), rng.integers(0, 100, 40), rng.integers(0, 5, 40) > 0
            if kind == "l":  # (2**62 + small steps: equal as doubles)
                y = (np.int64(2) ** 62 + rng.integers(0, 6, 40)) * rng.choice([-1, 1], 40)
                order = y.tolist()
            else:
                new = [f"s{rng.integers(0, 50)}" for _ in range(40)]
                y = np.array([strings.index(s) if s in strings else strings.append(s) or
                              len(strings) - 1 for s in new])
                order = new
                eng.order_strings(1 + np.argsort(np.argsort(strings, kind="stable")))
            eng.esg_in.add({"ts": ts, "k": k, "v": v, "y": y, "ok": ok.astype(np.int64)}, 0)
            eng.release_all(batch + 1)
            for t, key, val, o, tk in zip(ts.tolist(), k.tolist(), v.tolist(), order, ok.tolist()):
                w = (key, t // 20 * 20)
                mx, mn = best.get(w, (None, None))
                if tk and (mx is None or o >= mx[0]):
                    mx = (o, val)
                if tk and (mn is None or o <= mn[0]):
                    mn = (o, val)
                best[w] = (mx, mn)
            rec, _ = eng.state_rows()
            got = {(int(r[0]), int(r[1])): (int(r[2]), int(r[4])) for r in rec}
            want = {w: (mx[1], mn[1]) for w, (mx, mn) in best.items() if mx is not None}
            assert {w: x for w, x in got.items() if w in want} == want
            if batch == 2:
                eng.reconfigure(m=3)
            if batch == 3:
                eng = engine_cls.restore(op, eng.snapshot())
                if kind == "s":
                    eng.order_strings(1 + np.argsort(np.argsort(strings, kind="stable")))
    finally:
        eng.close()


def _a_float_slot_per_aggregate(op):
    """``op`` laid out as fused aggregations were until 2026-11-27: a float slot per aggregate."""
    import dataclasses

    from spark_stretch.engine.aggregates import MULTI

    k = int(op.builtin_ip[8])
    ip = op.builtin_ip.copy()
    ip[MULTI + 4 * k:MULTI + 5 * k] = np.arange(k)
    init_f = [0.0] * k
    for f, q in enumerate(op.float_cols):
        init_f[q] = op.init_f[f]
    return dataclasses.replace(op, builtin_ip=ip, n_float=k, init_f=tuple(init_f),
                               float_cols=None, _compiled=None)


@pytest.mark.parametrize("engine_cls", [Engine, SNEngine])
def test_a_snapshot_with_a_float_slot_per_aggregate_restores(engine_cls):
    """Checkpoints written when a fused aggregation kept a float slot for every aggregate (a
    count's and an int sum's unused) restore into today's narrower windows (a full snapshot
    and an incremental one on top), and the run goes on exactly as one that never stopped."""
    fused = aggregate_many(AGGS, key="k", WS=20)
    assert fused.n_float < len(AGGS)  # (count, the int sum and min, first of ints: none)
    wide = _a_float_slot_per_aggregate(fused)
    rng = np.random.default_rng(5)
    batches = []
    for b in range(6):
        ts = rng.integers(b * 10, b * 10 + 30, 40)
        batches.append({"ts": ts, "k": rng.integers(0, 5, 40), "v": rng.integers(-9, 9, 40),
                        "x": rng.normal(size=40), "take": rng.integers(0, 2, 40)})

    def step(eng, cols, b):
        eng.esg_in.add(dict(cols), 0)
        eng.esg_in.advance_watermark(b * 10)
        eng.drain()
        return eng.read_output(decode=False)[0]

    straight = engine_cls(fused, m=2, n=2, n_buckets=16)
    old = engine_cls(wide, m=2, n=2, n_buckets=16)
    for eng in (straight, old):
        eng.esg_in.add_sources([0], ordered=False, watermark=0)
    try:
        want = [step(straight, c, b) for b, c in enumerate(batches)]
        for b in range(3):
            step(old, batches[b], b)
        base = old.snapshot()
        step(old, batches[3], 3)
        delta = old.snapshot(delta=True)
        assert loads(base)["state"] and old.live_windows() > 0
    finally:
        straight.close()
        old.close()
    eng = engine_cls.restore(fused, base, deltas=[delta])
    try:
        assert eng.live_windows() == old.live_windows()
        assert sum(len(want[b]["key"]) for b in (4, 5)) > 0
        for b in (4, 5):
            got = step(eng, batches[b], b)
            assert set(got) == set(want[b])
            for c in want[b]:
                assert np.array_equal(got[c], want[b][c], equal_nan=True), c
    finally:
        eng.close()


def test_a_snapshot_of_another_window_layout_is_refused():
    """(Windows kept otherwise, say an approx_count_distinct's words in the record before its
    register pool): the restore names the layouts instead of running on garbage."""
    from spark_stretch.engine.errors import EngineError
    from spark_stretch.ops import aggregate_many

    old = aggregate_many([("count", None, "i", None), ("sum", "v", "i", None)], key="k", WS=10)
    new = aggregate_many([("count", None, "i", None), ("hll6", "v", "i", None)], key="k", WS=10)
    eng = Engine(old, m=1, n=1, n_buckets=4)
    try:
        snap = eng.snapshot()
    finally:
        eng.close()
    with pytest.raises(EngineError, match="0 pool words each.*2, 0 and 7.*new checkpoint"):
        Engine.restore(new, snap)


def test_a_snapshot_holds_the_windows_once_and_reads_as_written_before():
    """A snapshot's large arrays are written out of band (not copied into the pickle); its
    bytes, the file it writes and a snapshot of the format before (one pickle) all restore."""
    import pickle

    op = aggregate("sum", keys="words", value="v", WS=10, WA=5)
    eng = Engine(op, 1, 1, n_buckets=64)
    eng.esg_in.add_sources([0], ordered=False)
    n = 50_000
    eng.esg_in.add({"ts": np.ones(n, np.int64), "v": np.arange(n, dtype=np.float64),
                    "words": ListColumn(np.arange(n + 1), np.arange(n, dtype=np.int64))}, 0)
    eng.esg_in.advance_watermark(2)
    eng.drain()
    blob = eng.snapshot(clear_dirty=False)
    assert isinstance(blob, Blob) and len(blob.head) < 100_000 < len(blob) == len(bytes(blob))
    old = pickle.dumps(loads(blob), protocol=5)  # (a snapshot as written before blobs)
    want = sorted(zip(*[a.tolist() for a in eng.state.bucket_rows()[:2]]))
    for src in (blob, bytes(blob), old):
        again = Engine.restore(op, src)
        assert sorted(zip(*[a.tolist() for a in again.state.bucket_rows()[:2]])) == want
        again.close()
    eng.close()


def test_read_only_and_writable_batches_run_one_compiled_kernel():
    # numba types an array's read-only flag apart: Arrow's columns are read-only, computed ones
    # writable. Without frozen() each kind of batch compiled the 20-50 s kernel once more.
    from spark_stretch.engine import kernels as K

    ro = tweets(30, seed=1)
    for a in (ro["ts"], ro["words"].offsets, ro["words"].values):
        a.flags.writeable = False
    eng = Engine(wordcount(WS=10), 1, 2, n_buckets=8)
    eng.esg_in.add_sources([0], ordered=False)
    rw = tweets(30, t0=100, seed=2)  # (writable)
    eng.esg_in.add(ro, 0)
    eng.esg_in.add(rw, 0)
    eng.esg_in.advance_watermark(400)
    eng.drain()
    out, _ = eng.read_output()
    n_words = len(ro["words"].values) + len(rw["words"].values)
    assert out["count"].sum() == n_words  # (both batches counted)
    eng.close()
    sigs = K.agg_kernel.signatures
    assert sigs and all(not sig[7].mutable for sig in sigs), sigs  # ts: always read-only
    assert all(not a.mutable for sig in sigs for a in (*sig[11], *sig[12])), sigs  # the columns
