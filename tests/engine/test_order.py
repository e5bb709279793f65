"""Row ordering kernels (spark_stretch.engine.order) against numpy's stable np.lexsort."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_stretch.engine.order import lexsort, merge_runs


def _oracle(cols):
    return np.lexsort(list(cols)[::-1])


@st.composite
def tables(draw):
    """Columns of few distinct values (many ties, long tie runs) or many, some constant."""
    n = draw(st.integers(0, 300))
    ncols = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    cols = []
    for _ in range(ncols):
        distinct = draw(st.sampled_from([1, 2, 3, 50, 2 ** 62]))
        cols.append(rng.integers(-distinct // 2, distinct // 2 + 1, n, dtype=np.int64))
    return cols


@settings(max_examples=300, deadline=None)
@given(tables())
def test_lexsort_equals_numpys_stable_lexsort(cols):
    assert lexsort(cols).tolist() == _oracle(cols).tolist()


@settings(max_examples=300, deadline=None)
@given(tables(), st.lists(st.integers(0, 300), max_size=6))
def test_merge_of_sorted_runs_equals_a_stable_sort_of_their_concatenation(cols, cuts):
    n = len(cols[0])
    bounds = sorted({0, n} | {c for c in cuts if c <= n})
    runs = []  # each run sorted on its own, then concatenated
    for a, b in zip(bounds, bounds[1:]):
        part = [c[a:b] for c in cols]
        p = _oracle(part)
        runs.append([c[p] for c in part])
    cat = [np.concatenate([r[i] for r in runs]) if runs else c[:0] for i, c in enumerate(cols)]
    assert merge_runs(cat, bounds).tolist() == _oracle(cat).tolist()


def test_long_runs_of_ties_are_ordered_by_the_other_columns_then_the_row():
    rng = np.random.default_rng(0)
    n = 5000
    ts = np.zeros(n, np.int64)
    key = np.repeat(np.arange(5, dtype=np.int64), n // 5)  # runs of 1000 equal (ts, key)
    rng.shuffle(key)
    seq = rng.integers(0, 3, n)
    cols = [ts + 1, key, seq]
    assert lexsort(cols).tolist() == _oracle(cols).tolist()
    cols = [rng.integers(0, 2, n), key]  # no third column: row order inside a run
    assert lexsort(cols).tolist() == _oracle(cols).tolist()


def test_constant_columns_are_skipped():
    rng = np.random.default_rng(1)
    k = rng.integers(0, 4, 500)
    const = np.full(500, 7)
    assert (lexsort([const, k, const]) == np.argsort(k, kind="stable")).all()
    assert (lexsort([const]) == np.arange(500)).all()
