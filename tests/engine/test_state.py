"""State: interning, owner maps, bucket tables (exact keys, growth), nogil kernels vs naive references."""
import numpy as np
import pytest

from spark_stretch.engine import Engine, EngineError, Interner, balanced_owner_map
from spark_stretch.engine import kernels as K
from spark_stretch.engine.batch import take_list
from spark_stretch.engine.state import validate_owner_map
from spark_stretch.ops import aggregate, count


def test_interner_ids_are_exact_and_stable():
    it = Interner()
    a = it.intern(["x", "y", "x", "z"])
    b = it.intern(["z", "w"])
    assert a.tolist() == [0, 1, 0, 2] and b.tolist() == [2, 3]
    assert it.lookup([3, 0]) == ["w", "x"]
    assert Interner(it.strings()).intern(["w"]).tolist() == [3]
    with pytest.raises(EngineError, match="null"):
        it.intern(__import__("pyarrow").array(["a", None]))


def test_owner_map_validation_names_the_missing_bucket():
    om = balanced_owner_map(8, [0, 1])
    assert validate_owner_map(om, 8, [0, 1]).tolist() == [0] * 4 + [1] * 4
    with pytest.raises(EngineError, match="owner_map misses bucket 3: its owner 5"):
        validate_owner_map([0, 1, 0, 5, 0, 1, 0, 1], 8, [0, 1])
    with pytest.raises(EngineError, match=r"each of the B=8 buckets \(length 8\)"):
        validate_owner_map([0, 1], 8, [0, 1])
    with pytest.raises(EngineError, match="integer array"):
        validate_owner_map(np.zeros(8), 8, [0])


def _naive_bucket(key, nb):
    # plain-Python splitmix64 (oracle for the jitted mix64)
    m = (1 << 64) - 1
    z = (key + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (((z ^ (z >> 31)) >> 32) * nb) >> 32


def test_bucket_of_matches_naive_python():
    keys = np.array([0, 1, 2, -1, 2 ** 40 + 3, -(2 ** 62), (7 << 32) | 9], np.int64)
    got = K.buckets_of(keys, 1024)
    want = [_naive_bucket(int(k) & ((1 << 64) - 1), 1024) for k in keys]
    assert got.tolist() == want


def test_full_key_compare_no_collision_mistakes_and_growth():
    # One bucket: every key collides on the bucket, whose table grows from 4 slots to 200 windows.
    eng = Engine(count(key="k", WS=20, WA=10), m=1, n=1, n_buckets=1, cap=4)
    eng.esg_in.add_sources([0], ordered=False)
    keys = np.arange(-50, 50, dtype=np.int64) * 7919
    for t in (0, 1, 2):  # each key 3 times in windows [-10, 10) and [0, 20)
        eng.esg_in.add({"ts": np.full(len(keys), t, np.int64), "k": keys}, 0)
    eng.esg_in.advance_watermark(5)
    eng.drain()
    k, l, ai, _ = eng.state.bucket_rows()
    assert len(k) == 200 and eng.state.live_windows() == 200 and eng.metrics()["grows"] > 0
    assert set(zip(k.tolist(), l.tolist())) == {(int(x), y) for x in keys for y in (-10, 0)}
    assert (ai[:, 0] == 3).all()
    assert eng.state.bminl[0] == -10
    eng.esg_in.advance_watermark(30)
    eng.drain()
    out, _ = eng.esg_out.get_batch("driver")
    assert len(out["key"]) == 200 and (out["count"] == 3).all() and eng.state.live_windows() == 0
    eng.close()


def test_tables_grow_when_thirteen_sixteenths_full_on_average():
    """A kernel lets one bucket reach 15/16 before it grows the tables; the runtime grows them,
    by eighths, once the buckets holding windows are past 13/16 full on average (with thousands
    of buckets the fullest passes that long before the average; growing then left the tables
    about half empty), at once to the first size under it. One bucket of 64 slots: 60 windows
    fit (15/16), and after the segment the tables grow once, to 81 slots (60 is past 13/16 of
    72 too); the windows are all there, counted exactly."""
    eng = Engine(count(key="k", WS=10, WA=10), m=1, n=1, n_buckets=1, cap=64)
    eng.esg_in.add_sources([0], ordered=False)
    keys = np.arange(60, dtype=np.int64) * 7919
    eng.esg_in.add({"ts": np.zeros(60, np.int64), "k": keys}, 0)
    eng.esg_in.advance_watermark(1)
    eng.drain()
    assert eng.state.live_windows() == 60
    assert eng.state.cap == 81 and eng.metrics()["grows"] == 1
    more = np.arange(60, 65, dtype=np.int64) * 7919  # (65 of 81 slots, not past 13/16: no grow)
    eng.esg_in.add({"ts": np.full(5, 2, np.int64), "k": more}, 0)
    eng.esg_in.advance_watermark(3)
    eng.drain()
    assert eng.state.cap == 81 and eng.metrics()["grows"] == 1
    eng.esg_in.advance_watermark(30)
    eng.drain()
    out, _ = eng.esg_out.get_batch("driver")
    assert sorted(out["key"].tolist()) == sorted(np.concatenate([keys, more]).tolist())
    assert (out["count"] == 1).all() and eng.state.live_windows() == 0
    eng.close()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("VmRSS"))


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_a_grow_gives_the_old_tables_pages_back_as_it_goes():
    """Growing rehashes a chunk of buckets at a time and gives that chunk of the old table back
    to the system: the process never holds both tables whole (old + new was the peak). Held
    here on purpose, the old table has lost its pages: RSS rose by about new - old, not new;
    every window is where it was, by its contents."""
    eng = Engine(count(key="k", WS=100), m=1, n=1, n_buckets=256)
    eng.esg_in.add_sources([0], ordered=False)
    keys = np.random.default_rng(3).permutation(1_500_000).astype(np.int64) * 7919
    eng.esg_in.add({"ts": np.zeros(len(keys), np.int64), "k": keys}, 0)
    eng.esg_in.advance_watermark(0)
    eng.drain()
    st = eng.state
    before = sorted(zip(*(a.tolist() for a in st.bucket_rows()[:2])))
    old = st.rec
    rss = _rss()
    st.grow()
    grown = _rss() - rss
    assert st.rec.nbytes > old.nbytes > 16 << 20
    assert grown < st.rec.nbytes - old.nbytes // 2, (grown, old.nbytes, st.rec.nbytes)
    assert sorted(zip(*(a.tolist() for a in st.bucket_rows()[:2]))) == before
    assert st.live_windows() == len(keys)
    eng.close()


@pytest.mark.parametrize("engine_cls", ["Engine", "SNEngine"])
def test_tables_shrink_after_a_close_leaves_them_almost_empty(engine_cls):
    """Whole batches, as the aggregation runtime applies them: 40,000 windows of the first
    hour and 300 of the second; the watermark closes the first hour. The tables, sized for
    40,000, shrink to twice what is left (``shrink_sparse_tables``), smaller than an eighth;
    every row, out then and after the second hour closes, is the count and sum a sequential
    reference gives, windows the second hour's later tuples add grown again into the shrunk
    tables. Tables those windows fill are not shrunk by the next call."""
    from spark_stretch.engine import SNEngine
    from spark_stretch.ops import aggregate_many

    cls = {"Engine": Engine, "SNEngine": SNEngine}[engine_cls]
    eng = cls(aggregate_many([("count", None, "i", None), ("sum", "v", "i", None)], key="k",
                             WS=100, WA=100), m=2, n=2, n_buckets=64, threads=False)
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    assert eng.apply_whole_batches()
    rng = np.random.default_rng(5)
    first, second = rng.permutation(10 ** 6)[:40_000], rng.permutation(10 ** 6)[:300]
    k = np.concatenate([first, first[:5_000], second]).astype(np.int64)
    ts = np.concatenate([np.full(45_000, 10, np.int64), np.full(300, 150, np.int64)])
    v = rng.integers(-9, 9, len(k))
    rows = []

    def step(cols, watermark):
        eng.esg_in.add(cols, 0)
        eng.release_all(0)
        eng.esg_in.advance_watermark(watermark)
        eng.drain()
        before = [st.cap for st in eng._states()]
        shrunk = eng.shrink_sparse_tables(min_bytes=0)
        out = eng.esg_out.get_batch("driver")[0]
        rows.extend(zip(out["key"].tolist(), out["window_start"].tolist(), out["_0"].tolist(),
                        out["_1"].tolist()))
        return before, shrunk

    before, shrunk = step({"ts": ts, "k": k, "v": v}, 100)
    assert shrunk == len(eng._states()) and eng.metrics()["shrinks"] == shrunk
    assert all(st.cap * 8 <= cap for st, cap in zip(eng._states(), before))
    assert sum(st.live_windows() for st in eng._states()) == 300
    more = rng.permutation(10 ** 6)[:20_000].astype(np.int64)  # (the shrunk tables grow again)
    step({"ts": np.full(len(more), 160, np.int64), "k": more, "v": np.ones(len(more), np.int64)},
         100)
    assert eng.metrics()["shrinks"] == shrunk and eng.metrics()["grows"] > 0
    step({"ts": np.empty(0, np.int64), "k": np.empty(0, np.int64), "v": np.empty(0, np.int64)},
         300)
    k, ts, v = (np.concatenate([a, b]) for a, b in
                [(k, more), (ts, np.full(len(more), 160)), (v, np.ones(len(more), np.int64))])
    want = {}
    for key, t, x in zip(k.tolist(), ts.tolist(), v.tolist()):
        n, s = want.get((key, t // 100 * 100), (0, 0))
        want[(key, t // 100 * 100)] = (n + 1, s + x)
    assert sorted(rows) == sorted((key, w, n, s) for (key, w), (n, s) in want.items())
    eng.close()


@pytest.mark.parametrize("engine_cls,threads", [("Engine", True), ("Engine", False),
                                                 ("SNEngine", True)])
@pytest.mark.parametrize("later", ["few", "in_few_buckets"])
def test_a_close_gives_back_the_buckets_it_empties_as_it_fires(monkeypatch, engine_cls,
                                                               threads, later):
    """A close firing more rows than an output block holds (blocks of 1,000 rows here, of
    262,144 in the engine; tables of any size here, of 32 MB or more in the engine): the pages of
    the buckets each block emptied are given back as it goes (``buckets_given_back``), and at the
    segment's end the tables shrink (few windows left: ``few``) or, when the windows left fill a
    few buckets well (``in_few_buckets``: no shrink), those buckets are made empty slots again.
    Every row, out then and after more windows in every bucket close, is the count and sum a
    sequential reference gives: a bucket read as zeros after its pages went would be a window
    of key 0 there."""
    from spark_stretch.engine import SNEngine, runtime, spill
    from spark_stretch.engine.buckets import buckets_of
    from spark_stretch.ops import aggregate_many

    monkeypatch.setattr(runtime, "OUT_CHUNK_ROWS", 1_000)
    monkeypatch.setattr(runtime, "SHRINK_BYTES", 0)
    monkeypatch.setattr(spill, "CHUNK_BYTES", 0)
    cls = {"Engine": Engine, "SNEngine": SNEngine}[engine_cls]
    nb = 256
    eng = cls(aggregate_many([("count", None, "i", None), ("sum", "v", "i", None)], key="k",
                             WS=100, WA=100), m=2, n=2, n_buckets=nb, threads=threads,
              inline_rows=1)
    eng.esg_in.add_sources([0], ordered=False, watermark=0)
    assert eng.apply_whole_batches()
    rng = np.random.default_rng(11)
    pool = rng.permutation(10 ** 7)[:400_000].astype(np.int64) + 1
    first = pool[:60_000]
    if later == "few":
        second = pool[60_000:60_030]
    else:  # (2,000 windows in buckets 0-3: a fullest bucket far past an eighth of its slots)
        rest = pool[60_000:]
        second = rest[buckets_of(rest, nb) < 4][:2_000]
    more = pool[-20_000:]  # (then windows in every bucket, a given-back one included)
    rows, want = [], {}

    def step(k, ts, watermark):
        v = rng.integers(-9, 9, len(k))
        for key, t, x in zip(k.tolist(), ts.tolist(), v.tolist()):
            n, s = want.get((key, t // 100 * 100), (0, 0))
            want[(key, t // 100 * 100)] = (n + 1, s + x)
        eng.esg_in.add({"ts": ts, "k": k, "v": v}, 0)
        eng.release_all(0)
        eng.esg_in.advance_watermark(watermark)
        eng.drain()
        out = eng.esg_out.get_batch("driver")[0]
        rows.extend(zip(out["key"].tolist(), out["window_start"].tolist(), out["_0"].tolist(),
                        out["_1"].tolist()))

    caps = [st.cap for st in eng._states()]
    step(np.concatenate([first, second]), np.concatenate([np.full(len(first), 10),
                                                          np.full(len(second), 150)]), 100)
    m = eng.metrics()
    assert m["buckets_given_back"] > nb // 2
    assert all(not st.given_back.any() for st in eng._states())
    grown = [st.cap for st in eng._states()]
    if later == "few":
        assert m["shrinks"] == len(eng._states()) and all(c < 64 for c in grown), (caps, grown)
    else:  # (the state holding buckets 0-3 keeps its tables; an SN instance's other one not)
        assert m["shrinks"] == len(grown) - 1 and grown[0] >= 64, (caps, grown)
    step(more, np.full(len(more), 160), 100)
    step(np.empty(0, np.int64), np.empty(0, np.int64), 300)
    assert sorted(rows) == sorted((key, w, n, s) for (key, w), (n, s) in want.items())
    eng.close()


def test_given_back_buckets_read_as_zeros_until_settled(monkeypatch):
    """``give_back_empty`` drops the pages wholly inside the empty buckets it is given (they
    read as zeros, not as empty slots: the kernels must not see them), keeps a bucket holding
    a window, and ``settle_given_back`` makes them empty slots again when the tables do not
    shrink."""
    from spark_stretch.engine import spill
    from spark_stretch.engine.state import BucketState

    monkeypatch.setattr(spill, "CHUNK_BYTES", 0)
    st = BucketState(8, 2, 0, [0, 0], [], cap=4096)  # (4096 slots of 32 B: 32 pages a bucket)
    st.rec[5, 7, :] = [42, 100, 1, 2]
    st.bcount[5] = 1
    mine = np.array([True] * 7 + [False])
    assert st.give_back_empty(2, 8, mine[2:]) == 4  # (2, 3, 4, 6: not 5 with a window, not 7)
    assert (st.rec[3, 1000:3000, 1] == 0).all() and (st.rec[7, :, 1] == K.EMPTY).all()
    assert st.rec[5, 7].tolist() == [42, 100, 1, 2] and st.given_back.tolist() == [0, 0, 1, 1, 1, 0, 1, 0]
    st.bcount[0] = 4000  # (a full bucket: no shrink)
    assert not st.settle_given_back(4096)
    assert (st.rec[2:5, :, 1] == K.EMPTY).all() and not st.given_back.any()


def test_take_list_matches_python():
    off = np.array([0, 2, 2, 5], np.int64)
    vals = np.array([1, 2, 3, 4, 5], np.int64)
    o, v = take_list(off, vals, np.array([2, 0, 2, 1], np.int64))
    rows = [v[o[i]:o[i + 1]].tolist() for i in range(4)]
    assert rows == [[3, 4, 5], [1, 2], [3, 4, 5], []]


def test_session_tables_grow_when_thirteen_sixteenths_full_on_average():
    """Session windows as windows above: the session kernel lets one bucket reach 15/16 (a slot
    a key) and the runtime grows the tables once the buckets holding sessions are past 13/16
    full on average. Two buckets of 64 slots: 54 keys' sessions in one (past 13/16, under
    15/16), 10 in the other: no grow (it grew the tables when one bucket passed 3/4); 51 more
    keys in the second, past 15/16: one grow, to 72 slots a bucket (115 of 144 slots, not past
    13/16 on average: no second grow); every session emitted once, with its count, when the
    watermark passes its end."""
    from spark_stretch.engine.buckets import buckets_of

    candidates = np.arange(2_000, dtype=np.int64) * 7919
    at = buckets_of(candidates, 2)
    first, second = candidates[at == 0], candidates[at == 1]
    eng = Engine(aggregate("count", key="k", session_end="end"), m=1, n=1, n_buckets=2, cap=64,
                 lateness="window")
    eng.esg_in.add_sources([0], ordered=False, watermark=0)

    def add(keys, t):
        n = len(keys)
        eng.esg_in.add({"ts": np.full(n, t, np.int64), "k": keys,
                        "end": np.full(n, t + 5, np.int64)}, 0)
        eng.esg_in.advance_watermark(t)
        eng.drain()

    add(np.concatenate([first[:54], second[:10]]), 0)
    assert eng.state.cap == 64 and eng.metrics()["grows"] == 0
    add(second[10:61], 1)
    assert eng.state.cap == 72 and eng.metrics()["grows"] == 1
    eng.esg_in.advance_watermark(30)
    eng.drain()
    out, _ = eng.esg_out.get_batch("driver")
    keys = np.concatenate([first[:54], second[:61]])
    assert sorted(out["key"].tolist()) == sorted(keys.tolist())
    assert (out["count"] == 1).all()
    eng.close()
