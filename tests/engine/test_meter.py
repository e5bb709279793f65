"""The engine's meter: busy time per instance, tuples and keys per bucket, as the kernels see them."""

from __future__ import annotations

import numpy as np
import pytest

from spark_stretch.engine import Engine, ListColumn
from spark_stretch.engine import meter as meter_mod
from spark_stretch.ops import aggregate, wordcount
from spark_stretch.protocol.placement import bucket_of


def _words(rng, n, per, vocab):
    words = np.array([f"w{i}" for i in rng.zipf(1.4, n * per) % vocab], object)
    return ListColumn(np.arange(0, n * per + 1, per), words)


def _run(op, batch, B, m=2):
    """One batch through an engine of ``m`` instances (threads even for small segments); the
    meter's figures and the keys updated per bucket (from the emitted counts)."""
    eng = Engine(op, m=m, n=2, n_buckets=B, inline_rows=0)
    eng.esg_in.add_sources([0], ordered=False)
    eng.esg_in.add(batch, 0)
    eng.esg_in.advance_watermark(10_000)
    eng.drain()
    out, _ = eng.esg_out.get_batch("driver")
    exact = np.bincount(bucket_of(out["key"], B), weights=out["count"], minlength=B)
    return eng.meter.take(), exact, eng


def test_keys_per_bucket_are_the_kernels_and_every_instance_is_busy():
    rng = np.random.default_rng(1)
    got, exact, _ = _run(wordcount(WS=10), {"ts": np.sort(rng.integers(0, 100, 5000)),
                                            "words": _words(rng, 5000, 4, 300)}, B=64)
    assert got["tuples"] == 5000
    assert np.array_equal(got["bucket_load"], exact) and exact.sum() == 5000 * 4
    assert len(got["busy_s"]) == 2 and all(b > 0 for b in got["busy_s"])


def test_pair_keys_are_counted_per_pair_and_a_large_segment_is_sampled():
    rng = np.random.default_rng(2)
    n = 3 * meter_mod.SAMPLE  # counted on every third tuple, weighted 3
    op = aggregate(keys="words", pairs=True, B=2, WS=10)
    got, exact, _ = _run(op, {"ts": np.sort(rng.integers(0, 100, n)),
                              "words": _words(rng, n, 5, 50)}, B=128)
    assert got["tuples"] == n
    assert exact.sum() == n * (4 + 3)  # pairs at distance 1 and 2 of 5 words
    assert int(got["bucket_load"].sum()) == n * 7
    assert np.abs(got["bucket_load"] - exact).sum() / exact.sum() < 0.05


def test_take_resets_the_figures():
    got, exact, eng = _run(wordcount(WS=10), {"ts": np.array([1]),
                                              "words": ListColumn([0, 1], np.array(["a"], object))},
                           B=32, m=1)
    assert np.array_equal(got["bucket_load"], exact) and got["tuples"] == 1
    again = eng.meter.take()
    assert again["tuples"] == 0 and again["bucket_load"].sum() == 0 and sum(again["busy_s"]) == 0


def test_a_join_reports_busy_time_and_no_bucket_load():
    from spark_stretch.engine import JoinEngine
    from spark_stretch.ops import band_join

    rng = np.random.default_rng(3)
    eng = JoinEngine(band_join(WS=100), m=2, n=2, n_buckets=32, inline_rows=0)
    eng.esg_in.add_sources([0], stream=0, ordered=False)
    eng.esg_in.add_sources([1], stream=1, ordered=False)
    for s, cols in ((0, ("x", "y")), (1, ("a", "b"))):
        eng.esg_in.add({"ts": np.sort(rng.integers(0, 50, 200)),
                        **{c: rng.uniform(0, 50, 200) for c in cols}}, s)
    eng.esg_in.advance_watermark(1000)
    eng.drain()
    got = eng.meter.take()
    assert got["tuples"] == 400 and got["bucket_load"].sum() == 0
    assert all(b > 0 for b in got["busy_s"])


def test_a_join_restored_from_its_snapshot_continues_as_uninterrupted():
    # The join store (not bucket windows) is what a join's snapshot holds; a restore checks
    # its payload width, and continuing from it matches the engine that never stopped.
    from spark_stretch.engine import JoinEngine
    from spark_stretch.engine.errors import EngineError
    from spark_stretch.ops import band_join

    def feed(eng, lo, hi, wm, seed):
        rng = np.random.default_rng(seed)
        for s, cols in ((0, ("x", "y")), (1, ("a", "b"))):
            eng.esg_in.add({"ts": np.sort(rng.integers(lo, hi, 100)),
                            **{c: rng.uniform(0, 20, 100) for c in cols}}, s)
        eng.esg_in.advance_watermark(wm)
        eng.drain()
        out, _ = eng.read_output()
        return sorted(zip(*(out[c].tolist() for c in sorted(out) if not c.startswith("_"))))

    def fresh():
        eng = JoinEngine(band_join(WS=100), m=2, n=2, n_buckets=32)
        eng.esg_in.add_sources([0], stream=0, ordered=False)
        eng.esg_in.add_sources([1], stream=1, ordered=False)
        eng.esg_out.add_readers(["driver"])
        return eng

    whole = fresh()
    want = feed(whole, 0, 50, 50, 1) + feed(whole, 50, 100, 10_000, 2)
    part = fresh()
    got = feed(part, 0, 50, 50, 1)
    snap = part.snapshot()
    again = JoinEngine.restore(band_join(WS=100), snap)
    again.esg_out.add_readers(["driver"])
    got += feed(again, 50, 100, 10_000, 2)
    assert got == want and len(want) > 100
    with pytest.raises(EngineError, match="2 payload columns.*3"):
        JoinEngine.restore(band_join(WS=100, left=("x", "y", "z"), right=("a", "b", "c")), snap)
    for e in (whole, part, again):
        e.close()
