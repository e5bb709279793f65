"""Concurrency: m = n = 2 instances on 2 threads (nogil kernels) with an epoch switch every batch, in
driven and free-running mode, against the one-instance run. Run repeatedly to catch flakes."""
import numpy as np
import pytest

from spark_stretch.engine import Engine, ListColumn, SNEngine
from spark_stretch.ops import aggregate, paircount, wordcount


def tweet_batches(n_batches=30, per=3000, vocab=3000, seed=7):
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_batches):
        lens = rng.integers(8, 21, per)
        off = np.zeros(per + 1, np.int64)
        off[1:] = np.cumsum(lens)
        words = np.minimum(rng.zipf(1.3, off[-1]), vocab) - 1
        ts = np.sort(rng.integers(b * 100, b * 100 + 130, per))
        out.append({"ts": ts, "words": ListColumn(off, words), "v": rng.normal(size=per)})
    return out


BATCHES = tweet_batches()


def run(op, m, n, switch, engine_cls=Engine, free_running=False):
    eng = engine_cls(op, m, n, n_buckets=1024, inline_rows=0)
    eng.esg_in.add_sources([0, 1], ordered=False)
    rng = np.random.default_rng(0)
    if free_running:
        eng.start()
    try:
        for i, b in enumerate(BATCHES):
            half = len(b["ts"]) // 2
            for s, idx in ((0, np.arange(half)), (1, np.arange(half, len(b["ts"])))):
                eng.esg_in.add({"ts": b["ts"][idx], "words": b["words"].take(idx), "v": b["v"][idx]}, s)
            if switch:
                if i % 3 == 2:
                    eng.reconfigure(instances=[int(rng.integers(0, n))])
                else:
                    eng.reconfigure(instances=list(range(n)), owner_map=rng.integers(0, n, 1024))
            eng.esg_in.advance_watermark(i * 100 + 50)
            if not free_running:
                eng.drain()
        eng.esg_in.advance_watermark(10 ** 6)
        eng.drain(timeout=120) if free_running else eng.drain()
    finally:
        eng.close()
    out, _ = eng.read_output(decode=False)
    return out, eng.metrics()


@pytest.fixture(scope="module")
def oracles():
    ops = {"wordcount": wordcount(WS=200, WA=100), "paircount": paircount(B=3, WS=100),
           "sum": aggregate("sum", keys="words", value="v", WS=150, WA=50)}
    return {k: (op, run(op, 1, 1, switch=False)[0]) for k, op in ops.items()}


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("name", ["wordcount", "paircount", "sum"])
def test_two_threads_with_a_switch_every_batch_equal_one_instance(oracles, name):
    op, want = oracles[name]
    got, m = run(op, 2, 2, switch=True)
    same(got, want)
    assert m["epoch_switches"] == len(BATCHES)


def test_free_running_two_threads_with_switches_equal_one_instance(oracles):
    op, want = oracles["paircount"]
    got, m = run(op, 2, 2, switch=True, free_running=True)
    same(got, want)
    assert m["epoch_switches"] == len(BATCHES)


def test_shared_nothing_two_threads_with_switches_equal_one_instance(oracles):
    op, want = oracles["wordcount"]
    got, m = run(op, 2, 2, switch=True, engine_cls=SNEngine)
    same(got, want)
    assert m["state_bytes_copied"] > 0
