"""The papers' example operators against plain-Python oracles, under random reconfiguration schedules:
pass-through with I = 2 (Op. 15), ScaleJoin band join (Op. 10), NYSE hedge self-join (Q6), value barrier
(dgs-flumina, two composed operators), longest tweet per hashtag (Alg. 7), user-defined numba
f_U/f_O/f_S with a single-type window, and the plain-Python escape hatch."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import njit

from spark_stretch.engine import Engine, Operator
from spark_stretch.engine.reference import RefOp, reference_run
from spark_stretch.engine.factory import engine_class
from spark_stretch.engine.store import JoinEngine
from spark_stretch.ops import (band_join, hedge_join, longest, passthrough, value_barrier_partials,
                               value_barrier_totals)
from spark_stretch.testing.engine import batch_to_rows, rows_to_batch, run_engine, same_rows
from tests.engine.stretch_scripts import reconfigurations, scripts

SET = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- pass-through (Operator 15), I = 2 with two schemas ------------------------------------------
def ref_passthrough(K):
    def update(s, stream, t, k):
        if stream == 0:
            return s, [{"src": 0, "a": t["a"], "b": 0.0, "c": 0.0}]
        return s, [{"src": 1, "a": 0, "b": t["b"], "c": t["c"]}]
    return RefOp(None, None, "multi", lambda s, t: list(range(K)), lambda: None, update, None)


PASSTHROUGH = passthrough(K=3)


@SET
@given(script=scripts(schemas=({"a": "int64"}, {"b": "float64", "c": "float64"}), n=3, n_buckets=16))
def test_passthrough_two_streams(script):
    cols = [{"a": np.int64}, {"b": np.float64, "c": np.float64}]
    got, _ = run_engine(PASSTHROUGH, script, cols, m=2, n=3, n_buckets=16, inline_rows=0)
    same_rows(got, reference_run(ref_passthrough(3), script), ["src", "a", "b", "c"])


# ---- joins ---------------------------------------------------------------------------------------
def join_oracle(script, WS, K, pred, left, right):
    """Operator 10 in plain Python: per share k, stored tuples; match the other stream; store round robin."""
    wm, src_stream, tuples, order = {}, {}, [], 0
    for act in script:
        if act[0] == "sources":
            for s in act[1]:
                src_stream[s], wm[s] = act[2], -(2 ** 62)
        elif act[0] == "add":
            for r in act[2]:
                if r["ts"] > wm[act[1]]:
                    tuples.append((r["ts"], act[1], order, src_stream[act[1]], r))
                    order += 1
        elif act[0] == "wm":
            wm = {s: max(w, act[1]) for s, w in wm.items()}
    W = min(wm.values())
    ready = sorted((t for t in tuples if t[0] <= W), key=lambda t: t[:3])
    stores = {k: [] for k in range(K)}
    out = []
    for rank, (ts, _, _, s, r) in enumerate(ready):
        pay = [float(r[c]) for c in (left if s == 0 else right)]
        for k in range(K):
            stores[k] = [e for e in stores[k] if e[0] > ts - WS]
            sub = 0
            for ets, es, epay in stores[k]:
                if es == s:
                    continue
                lp, rp = (pay, epay) if s == 0 else (epay, pay)
                if pred(lp, rp):
                    row = {"ts": ts, "key": k, "window_start": -1, "_seq": rank, "_sub": sub}
                    row.update({f"l_{c}": v for c, v in zip(left, lp)})
                    row.update({f"r_{c}": v for c, v in zip(right, rp)})
                    out.append(row)
                    sub += 1
            if rank % K == k:
                stores[k].append((ts, s, pay))
    out.sort(key=lambda r: (r["ts"], r["key"], r["_seq"], r["_sub"]))
    return out


def band(lp, rp):
    return abs(lp[0] - rp[0]) <= 10 and abs(lp[1] - rp[1]) <= 10


def hedge(lp, rp):
    if lp[0] == rp[0] or lp[2] == 0 or rp[2] == 0:
        return False
    ndl, ndr = (lp[1] - lp[2]) / lp[2], (rp[1] - rp[2]) / rp[2]
    return ndl != 0 and -1.05 <= ndr / ndl


@st.composite
def join_scripts(draw, n=3, n_buckets=16):
    script = [("sources", [0], 0), ("sources", [1], 1)]
    t = 0
    for _ in range(draw(st.integers(1, 12))):
        for s, (c1, c2) in ((0, ("x", "y")), (1, ("a", "b"))):
            if draw(st.booleans()):
                rows = [{"ts": t + draw(st.integers(-2, 10)), c1: float(draw(st.integers(0, 40))),
                         c2: float(draw(st.integers(0, 40)))} for _ in range(draw(st.integers(1, 5)))]
                script.append(("add", s, rows))
        if draw(st.integers(0, 2)) == 0:
            script.append(("reconf", draw(reconfigurations(n, n_buckets))))
        t += draw(st.integers(0, 6))
        script.append(("wm", t))
    return script


@SET
@given(script=join_scripts())
def test_band_join_matches_oracle(script):
    cols = [{"x": np.float64, "y": np.float64}, {"a": np.float64, "b": np.float64}]
    got, eng = run_engine(band_join(WS=8, shares=5), script, cols, m=2, n=3, n_buckets=16,
                          engine_cls=JoinEngine, inline_rows=0)
    want = join_oracle(script, 8, 5, band, ("x", "y"), ("a", "b"))
    same_rows(got, want, ["l_x", "l_y", "r_a", "r_b"])
    again, _ = run_engine(band_join(WS=8, shares=5), script, cols, m=2, n=3, n_buckets=16,
                          engine_cls=JoinEngine, inline_rows=0)
    assert again == got  # identical across runs


@st.composite
def trade_scripts(draw, n=3, n_buckets=16):
    """The same random trades fed as stream 0 and stream 1 (self-join), with reconfigurations."""
    script = [("sources", [0], 0), ("sources", [1], 1)]
    t = 0
    for _ in range(draw(st.integers(1, 10))):
        rows = [{"ts": t + draw(st.integers(0, 5)), "id": float(draw(st.integers(0, 3))),
                 "price": float(draw(st.integers(90, 110))), "avg": float(draw(st.sampled_from([95, 100, 105])))}
                for _ in range(draw(st.integers(0, 4)))]
        script += [("add", 0, rows), ("add", 1, rows)]
        if draw(st.integers(0, 2)) == 0:
            script.append(("reconf", draw(reconfigurations(n, n_buckets))))
        t += draw(st.integers(0, 6))
        script.append(("wm", t))
    return script


@SET
@given(script=trade_scripts())
def test_hedge_self_join_matches_oracle(script):
    cols = [{"id": np.float64, "price": np.float64, "avg": np.float64}] * 2
    got, _ = run_engine(hedge_join(WS=10, shares=3), script, cols, m=2, n=3, n_buckets=16,
                        engine_cls=JoinEngine, inline_rows=0)
    want = join_oracle(script, 10, 3, hedge, ("id", "price", "avg"), ("id", "price", "avg"))
    same_rows(got, want, ["l_id", "l_price", "r_id", "r_price"])


def nyse_trades(n, seed):
    """Synthetic NYSE-like trades of 10 companies: price = previous-day average * (1 + noise)."""
    rng = np.random.default_rng(seed)
    avg = rng.integers(50, 500, 10)
    comp = rng.integers(0, 10, n)
    price = np.round(avg[comp] * (1 + rng.normal(0, 0.02, n))).astype(np.int64)
    ts = np.sort(rng.integers(0, 200, n))
    return [{"ts": int(t), "id": f"C{c}", "price": int(p), "avg": int(avg[c])} for t, c, p in zip(ts, comp, price)]


@pytest.mark.parametrize("seed", [0, 1])
def test_nyse_hedge_self_join_on_synthetic_prices(seed):
    trades = nyse_trades(150, seed)
    op = hedge_join(WS=30, shares=4)
    eng = engine_class(op)(op, 2, 2, n_buckets=16, inline_rows=0)
    eng.esg_in.add_sources([0], stream=0, ordered=False)
    eng.esg_in.add_sources([1], stream=1, ordered=False)
    for i, lo in enumerate(range(0, 200, 25)):
        part = [r for r in trades if lo <= r["ts"] < lo + 25]
        if part:
            b = rows_to_batch(part, {"id": object, "price": np.int64, "avg": np.int64})
            eng.esg_in.add(b, 0)  # the same stream fed twice (self-join)
            eng.esg_in.add(b, 1)
        eng.esg_in.advance_watermark(lo + 24)
        eng.reconfigure(instances=[i % 2] if i % 3 else [0, 1])
        eng.drain()
    got = batch_to_rows(eng.read_output(decode=False)[0])
    ids = {s: float(i) for i, s in enumerate(eng.interner.strings())}
    script = [("sources", [0], 0), ("sources", [1], 1),
              ("add", 0, [{**r, "id": ids[r["id"]]} for r in trades]),
              ("add", 1, [{**r, "id": ids[r["id"]]} for r in trades]), ("wm", 199)]
    want = join_oracle(script, 30, 4, hedge, ("id", "price", "avg"), ("id", "price", "avg"))
    assert len(want) > 0
    same_rows(got, want, ["l_id", "l_price", "r_id", "r_price"])
    assert all(r["l_id"] != r["r_id"] for r in got)


# ---- value barrier: two composed operators -----------------------------------------------------
@st.composite
def vb_inputs(draw):
    values, barriers, t = [], [], 0
    for _ in range(draw(st.integers(1, 30))):
        t += draw(st.integers(0, 3))
        if draw(st.integers(0, 4)) == 0:
            barriers.append({"ts": t, "b": 0})
        else:
            values.append({"ts": t, "sub": draw(st.integers(0, 2)), "v": draw(st.integers(-5, 9))})
    return values, barriers, t, draw(st.lists(reconfigurations(3, 16), max_size=4))


VB = (value_barrier_partials(3), value_barrier_totals())


@SET
@given(inp=vb_inputs())
def test_value_barrier_two_composed_operators(inp):
    values, barriers, T, reconfs = inp
    p1 = Engine(VB[0], 2, 3, n_buckets=16, out_reader=None, inline_rows=0)
    p2 = Engine(VB[1], 1, 3, n_buckets=16, esg_in=p1.esg_out, inline_rows=0)
    p1.esg_in.add_sources([0], stream=0, ordered=True)  # paper model: ordered sources
    p1.esg_in.add_sources([1], stream=1, ordered=True)
    cut = T // 2
    for lo, hi in ((-1, cut), (cut, T + 1)):
        v = [r for r in values if lo < r["ts"] <= hi]
        b = [r for r in barriers if lo < r["ts"] <= hi]
        if v:
            p1.esg_in.add(rows_to_batch(v, {"sub": np.int64, "v": np.int64}), 0)
        if b:
            p1.esg_in.add(rows_to_batch(b, {"b": np.int64}), 1)
        for rc in reconfs[:2] if lo < 0 else reconfs[2:]:
            p1.reconfigure(**rc)
            p2.reconfigure(**rc)
        p1.esg_in.add_watermark(hi, 0)
        p1.esg_in.add_watermark(hi, 1)
        p1.drain()
        p2.drain()
    p1.esg_in.advance_watermark(T + 5)
    p1.drain()
    p2.drain()
    out, _ = p2.read_output()
    # oracle: sum of the values strictly after the previous barrier and up to this one (ties: values first)
    events = sorted([(r["ts"], 0, r["v"]) for r in values] + [(r["ts"], 1, None) for r in barriers])
    want, acc = [], 0
    for ts, kind, v in events:
        if kind == 0:
            acc += v
        else:
            want.append((ts + 1, acc))
            acc = 0
    assert list(zip(out["ts"].tolist(), out["total"].tolist())) == want


# ---- longest tweet per hashtag (Alg. 7 / Operator 9) -------------------------------------------
def test_longest_tweet_per_hashtag_paper_example():
    op = longest(keys="hashtags", value="text", WS=60, WA=30)
    eng = Engine(op, 2, 2, n_buckets=16)
    eng.esg_in.add_sources([0], ordered=True)
    tw = [(9 * 60 + 50, "hello #pink", ["pink"]), (9 * 60 + 58, "hi #red #pink", ["red", "pink"]),
          (10 * 60 + 5, "#red", ["red"])]
    import pyarrow as pa
    rb = pa.RecordBatch.from_pydict({"ts": [t for t, _, _ in tw], "text": [list(x) for _, x, _ in tw],
                                     "hashtags": [h for _, _, h in tw]})
    eng.esg_in.add(rb, 0)
    eng.esg_in.add_watermark(11 * 60, 0)
    eng.drain()
    out, _ = eng.read_output()
    got = [(int(ts), int(l), eng.interner.lookup([k])[0], int(v))
           for ts, l, k, v in zip(out["ts"], out["window_start"], out["key"], out["longest"])]
    # 60-minute windows every 30 minutes, result at the window end, ordered by (ts, key id, start)
    assert got == [(600, 540, "pink", 13), (600, 540, "red", 13), (630, 570, "pink", 13),
                   (630, 570, "red", 13), (660, 600, "red", 4)]


# ---- user-defined numba f_U / f_O / f_S, single window type; plain-Python escape hatch ----------
def _decay_functions(jit):
    def mk(cols, row, out):
        out[0] = cols[0][row]
        return 1

    def up(ai, af, cols, row, key, oi, of):
        ai[0] += 1
        af[0] += cols[1][row]
        return 0

    def out(ai, af, key, l, oi, of):
        oi[0, 0] = ai[0]
        of[0, 0] = af[0]
        return 1

    def slide(ai, af):  # keep half of the count (purge stale tuples), drop when empty
        ai[0] = ai[0] // 2
        af[0] = af[0] / 2
        return ai[0] > 0

    return [jit(f) for f in (mk, up, out, slide)]


def decay_op(python=False):
    mk, up, out, slide = _decay_functions((lambda f: f) if python else njit(nogil=True))
    return Operator(WA=3, WS=6, I=1, f_MK=(mk,), WT="single", f_U=(up,), f_O=out, f_S=slide,
                    S=(("n", "i"), ("v", "f")), columns=((("k", "int64"), ("v", "float64")),), python=python)


def ref_decay():
    def update(s, stream, t, k):
        return (s[0] + 1, s[1] + t["v"]), []

    def slide(s):
        n = s[0] // 2
        return (n, s[1] / 2) if n > 0 else None

    return RefOp(3, 6, "single", lambda s, t: [t["k"]], lambda: (0, 0.0), update,
                 lambda s, k, l: [{"n": s[0], "v": s[1]}], slide)


DECAY = decay_op()
DECAY_PY = decay_op(python=True)


@SET
@given(script=scripts(schemas=({"k": "sub", "v": "float64"},), n=3, n_buckets=16))
def test_user_numba_functions_single_window_type(script):
    got, _ = run_engine(DECAY, script, [{"k": np.int64, "v": np.float64}], m=2, n=3, n_buckets=16,
                        inline_rows=0)
    same_rows(got, reference_run(ref_decay(), script), ["n", "v"])


@settings(max_examples=5, deadline=None)
@given(script=scripts(schemas=({"k": "sub", "v": "float64"},), n=2, n_buckets=16, max_steps=5))
def test_plain_python_escape_hatch_gives_the_same_rows(script):
    cols = [{"k": np.int64, "v": np.float64}]
    fast, _ = run_engine(DECAY, script, cols, m=2, n=2, n_buckets=16)
    slow, _ = run_engine(DECAY_PY, script, cols, m=2, n=2, n_buckets=16)
    assert fast == slow
