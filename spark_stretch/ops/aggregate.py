"""Built-in windowed aggregations as O+ specialisations: count, sum, min, max, mean, longest per key.

Keys come from one of three built-in multi-key functions ``f_MK``:

- ``key="col"``: one key per tuple from an int64 (or string, interned) column;
- ``keys="col"``: every element of a list column (a tweet's words / hashtags), one update per occurrence;
- ``keys="col", pairs=B``: every ordered pair ``(w[i], w[j])``, ``i < j``, ``j - i <= B`` (``B=None``:
  unbounded) as the exact key ``(w[i] << 32) | w[j]`` from 32-bit word ids.

All run in the cached, compiled engine kernel (no Python per row).
"""
from __future__ import annotations

import re

import numpy as np

from ..engine.aggregates import uses_float
from ..engine import kernels as K
from ..engine.errors import EngineError
from ..engine.batch import ListColumn
from ..engine.operator import Operator

_AGGS = {"count": None, "sum": (K.AGG_SUM_I, K.AGG_SUM_F), "min": (K.AGG_MIN_I, K.AGG_MIN_F),
         "max": (K.AGG_MAX_I, K.AGG_MAX_F), "mean": (None, K.AGG_MEAN), "longest": (K.AGG_MAX_I, None),
         "first": (K.AGG_FIRST_I, K.AGG_FIRST_F), "last": (K.AGG_LAST_I, K.AGG_LAST_F),
         "max_by": (K.AGG_MAXBY_I, None), "min_by": (K.AGG_MINBY_I, None),
         "min_s": (K.AGG_MIN_S, None), "max_s": (K.AGG_MAX_S, None),
         "max_by_l": (K.AGG_MAXBY_L, None), "min_by_l": (K.AGG_MINBY_L, None),
         "max_by_s": (K.AGG_MAXBY_S, None), "min_by_s": (K.AGG_MINBY_S, None),
         "by_key": (K.AGG_BY_KEY, None), "count_any": (K.AGG_COUNT_ANY, None)}
# the aggregates that run in aggregate_many only: strings ranked, exact orderings in two slots
_FUSED = {"min_s", "max_s", "max_by_l", "min_by_l", "max_by_s", "min_by_s", "by_key", "count_any"}
# ... of them, those that take a take= column (a null's flag)
_TAKES = {"first", "last", "min_s", "max_s", "max_by_l", "min_by_l", "max_by_s", "min_by_s"}
_HLL = re.compile(r"hll(\d+)")  # approx_count_distinct's registers: "hll<p>"
_I64 = np.iinfo(np.int64)
_EMPTY_F = np.empty(0, np.float64)
_EMPTY_I = np.empty(0, np.int64)
UNBOUNDED = 1 << 30


def aggregate(agg="count", *, key=None, keys=None, pairs=False, B=None, value=None, value_type="f",
              WS=None, WA=None, name=None, stamped=False, session_end=None, take=None,
              by=None, _fused=False) -> Operator:
    """A windowed aggregation per key (an ``A+`` when the key function yields many keys).

    Parameters
    ----------
    agg : {"count", "sum", "min", "max", "mean", "longest", "first", "last"}
        ``longest`` is the maximum of an int ``value`` column (the length of the tweet, Alg. 7).
        ``first`` (``last``) is the value of the window's tuple with the earliest (latest)
        timestamp (ties: the first (last) to arrive).
    key : str, optional
        Scalar key column (int ids or strings).
    keys : str, optional
        List key column (multi-key: one update per element, or per pair with ``pairs=True``).
    pairs : bool
        Count pairs of list elements at distance ``<= B`` (``B=None``: unbounded).
    value : str, optional
        Value column for sum/min/max/mean/longest.
    value_type : {"f", "i"}
        Aggregate the value as float64 or int64 (exact) for sum/min/max.
    WS, WA : int
        Window size and advance (``WA`` defaults to ``WS``: tumbling). Both None: keyed running aggregate.
    session_end : str, optional
        Session windows (Spark's ``session_window``) in place of ``WS``/``WA``: the int64
        column of each tuple's session end (its timestamp plus its gap); see
        :mod:`spark_stretch.engine.sessions`. The output has the session's end as column
        ``end``. With ``stamped=True`` the sessions are kept (complete mode): tuples merge
        them in any order, none is emitted or evicted, ``Engine.state_rows`` reads them.
    by : str, optional
        ``max_by``/``min_by`` only: the ordering column (numbers; a NaN, a null, is skipped):
        the int ``value`` of the tuple with the largest (smallest), ties: the last.
    take : str, optional
        ``first``/``last``/``hll<p>`` only: an int column; tuples where it is 0 are skipped
        (Spark's ``first(x, ignoreNulls=True)`` with ``take`` = "x is not null").
    stamped : bool
        Keep in each window the stamp of the batch that last updated it (``Engine.release_all``,
        ``Engine.state_rows``): Spark's update and complete output modes. A tuple then closes no
        window; windows close at a segment's watermark only.

    Examples
    --------
    >>> op = aggregate("sum", key="user", value="amount", WS=10)
    >>> op.S
    (('sum', 'f'),)
    """
    hll = _HLL.fullmatch(agg)
    if agg not in _AGGS and not hll:
        raise EngineError(f"agg={agg!r}; use one of {sorted(_AGGS)} or 'hll<p>'")
    if hll and not _fused:
        raise EngineError(f"agg={agg!r}: an approximate distinct count's registers run in "
                          "aggregate_many (in its register pool)")
    if agg in _FUSED and not _fused:
        raise EngineError(f"agg={agg!r} runs in aggregate_many (strings ranked, or an exact "
                          "ordering kept in a second aggregate)")
    if hll and not 4 <= int(hll.group(1)) <= 18:
        raise EngineError(f"agg={agg!r}: HLL++ takes 4 to 18 index bits")
    if (key is None) == (keys is None):
        raise EngineError(f"give exactly one of key= (scalar key column) or keys= (list column); got key={key!r}, keys={keys!r}")
    if pairs and keys is None:
        raise EngineError("pairs=True needs keys= (a list column)")
    if agg != "count" and value is None:
        raise EngineError(f"agg={agg!r} needs value= (the column to aggregate)")
    if value_type not in ("f", "i"):
        raise EngineError(f"value_type={value_type!r}; use 'f' (float64) or 'i' (int64)")
    if agg == "longest":
        value_type = "i"
    if agg == "mean":
        value_type = "f"
    if WA is None:
        WA = WS
    if session_end is not None and WS is not None:
        raise EngineError("session_end= takes the place of WS/WA")
    if take is not None and agg not in _TAKES and not hll:
        raise EngineError(f"take= is for agg={sorted(_TAKES)} or 'hll<p>', not {agg!r}")
    if (by is None) != (agg not in ("max_by", "min_by")):
        raise EngineError(f"agg={agg!r} with by={by!r}: by= (the ordering column) is for "
                          "agg='max_by' or 'min_by', and they need it")
    if agg in ("max_by", "min_by") or agg in _FUSED or hll:
        value_type = "i"
    if B is not None and (not pairs or int(B) < 1):
        raise EngineError(f"B={B}; the pair distance B needs pairs=True and B >= 1")
    if agg == "count":
        code, out_kind = K.AGG_COUNT, "i"
    elif hll:
        code, out_kind = K.AGG_HLL + int(hll.group(1)), "i"
    else:
        ci, cf = _AGGS[agg]
        code = ci if value_type == "i" else cf
        out_kind = value_type
    mk = K.MK_PAIRS if pairs else K.MK_LIST
    ip = np.zeros(8, np.int64)
    ip[0], ip[1], ip[2], ip[3] = mk, (UNBOUNDED if B is None else int(B)), code, int(stamped)
    init_i, init_f = 0, 0.0
    if code == K.AGG_MIN_I:
        init_i = _I64.max
    elif code == K.AGG_MAX_I:
        init_i = _I64.min
    elif code == K.AGG_MIN_F:
        init_f = np.inf
    elif code == K.AGG_MAX_F:
        init_f = -np.inf
    elif code in (K.AGG_FIRST_I, K.AGG_LAST_I):  # (the timestamp of the value taken)
        init_f = np.inf if code == K.AGG_FIRST_I else -np.inf
    elif code in (K.AGG_FIRST_F, K.AGG_LAST_F):
        init_i = _I64.max if code == K.AGG_FIRST_F else _I64.min
    elif code in (K.AGG_MAXBY_I, K.AGG_MINBY_I):  # (the extremum of the ordering)
        init_f = -np.inf if code == K.AGG_MAXBY_I else np.inf
    elif code in (K.AGG_MIN_S, K.AGG_MAX_S, K.AGG_MINBY_S, K.AGG_MAXBY_S):  # (a rank)
        init_f = np.inf if code in (K.AGG_MIN_S, K.AGG_MINBY_S) else -np.inf
    key_col = key if key is not None else keys
    out_name = "longest" if agg == "longest" else agg

    def prepare(stream, batch, values_only=False):
        cols = _prepare(stream, batch, values_only)
        if session_end is None or values_only:
            return cols
        if batch is None:
            return cols + (_EMPTY_I,)
        if session_end not in batch:
            raise EngineError(f"session end column {session_end!r} is not an input column (columns: {sorted(batch)})")
        return cols + (np.ascontiguousarray(batch[session_end], np.int64),)

    def _prepare(stream, batch, values_only):
        if batch is None:
            return (np.zeros(1, np.int64), _EMPTY_I, _EMPTY_F, _EMPTY_I)
        if key_col not in batch:
            raise EngineError(f"key column {key_col!r} is not an input column (columns: {sorted(batch)})")
        kc = batch[key_col]
        off = vals = None  # (values only: a fused aggregation's later aggregates, keyed by the first's)
        if not values_only:
            off, vals = _keys(kc)
        vf, vi = _EMPTY_F, _EMPTY_I
        if value is not None:
            if value not in batch:
                raise EngineError(f"value column {value!r} is not an input column (columns: {sorted(batch)})")
            v = batch[value]
            if isinstance(v, ListColumn):
                v = v.lengths() if agg == "longest" else None
                if v is None:
                    raise EngineError(f"value column {value!r} is a list column; agg={agg!r} needs numbers")
            if value_type == "f":
                vf = np.ascontiguousarray(v, np.float64)
            else:
                vi = np.ascontiguousarray(v, np.int64)
            if agg in _TAKES or hll:  # (take flags: the column of the other kind)
                vf, vi = _take_flags(batch, take, len(kc), vf, vi, value_type)
            elif by is not None:
                if by not in batch:
                    raise EngineError(f"by column {by!r} is not an input column (columns: {sorted(batch)})")
                vf = np.ascontiguousarray(batch[by], np.float64)
        return (off if values_only else np.ascontiguousarray(off, np.int64), vals, vf, vi)

    def _keys(kc):  # (the offsets of each row's keys and the keys, int64)
        if keys is not None:
            if not isinstance(kc, ListColumn):
                raise EngineError(f"keys column {key_col!r} has type {kc.dtype}; keys= needs a list column "
                                  "(use key= for a scalar key column)")
            off, vals = kc.offsets, kc.values
        else:
            if isinstance(kc, ListColumn):
                raise EngineError(f"key column {key_col!r} is a list column; use keys= for list columns")
            vals = kc
            off = np.arange(len(kc) + 1, dtype=np.int64)
        if not np.issubdtype(vals.dtype, np.integer):
            raise EngineError(f"key column {key_col!r} has dtype {vals.dtype}; keys must be int ids or strings")
        vals = np.ascontiguousarray(vals, np.int64)
        # (pairs: an id flagged ~id, negative, starts no pair here: another host's first word)
        if pairs and vals.size and (vals.min() < -2 ** 31 or vals.max() >= 2 ** 31):
            raise EngineError(f"keys column {key_col!r} has ids outside [0, 2**31); pair keys pack two 32-bit ids")
        return off, vals

    def decode(k, interner):
        k = np.asarray(k, np.int64)
        if pairs:
            return {"key_a": k >> 32, "key_b": k & 0xFFFFFFFF}
        return {}

    if session_end is not None:  # (start, end, accumulator); the end is an output column
        S, ints = (("end", "i"), (out_name, out_kind)), (0, 0, init_i)
    else:
        S, ints = ((out_name, out_kind),), (init_i, 0)[:1 + int(stamped)]
    return Operator(WA=WA, WS=WS, I=1, WT="multi", S=S, n_int=len(ints), session_end=session_end,
                    n_float=1, init_i=ints, init_f=(init_f,), builtin_ip=ip, builtin_fp=np.zeros(1),
                    prepare=prepare, decode=decode, checks_values=pairs,
                    name=name or f"{agg}({key_col}{', pairs B=' + str(B) if pairs else ''})")


# which value columns an aggregate reads: its int values (vi), its float values (vf); a first or
# last reads its take flags from the column of the other kind
_BY = (K.AGG_MAXBY_L, K.AGG_MINBY_L, K.AGG_MAXBY_S, K.AGG_MINBY_S)
_READS_I = {K.AGG_SUM_I, K.AGG_MIN_I, K.AGG_MAX_I, K.AGG_FIRST_I, K.AGG_LAST_I, K.AGG_FIRST_F,
            K.AGG_LAST_F, K.AGG_MAXBY_I, K.AGG_MINBY_I, K.AGG_MIN_S, K.AGG_MAX_S, *_BY,
            K.AGG_BY_KEY, K.AGG_COUNT_ANY}
_READS_F = {K.AGG_SUM_F, K.AGG_MIN_F, K.AGG_MAX_F, K.AGG_MEAN, K.AGG_FIRST_F, K.AGG_LAST_F,
            K.AGG_FIRST_I, K.AGG_LAST_I, K.AGG_MAXBY_I, K.AGG_MINBY_I, K.AGG_MIN_S, K.AGG_MAX_S,
            *_BY}


# aggregates that read their value column and nothing else (no take flags, no ordering): the
# ones reading the same column share its copy
_PLAIN_I = {K.AGG_SUM_I, K.AGG_MIN_I, K.AGG_MAX_I, K.AGG_COUNT_ANY}
_PLAIN_F = {K.AGG_SUM_F, K.AGG_MIN_F, K.AGG_MAX_F, K.AGG_MEAN}


def _value_slots(reads, plain, values):
    """Each aggregate's value column among a fused aggregation's (-1: it reads none), and the
    aggregate that provides each column: one column per value column that plain aggregates
    read (sum, min, max and mean of ``price``: one), one per other reader."""
    slot_of, slots, first = {}, [], []
    for q, r in enumerate(reads):
        if not r:
            slots.append(-1)
            continue
        key = ("value", values[q]) if plain[q] else ("aggregate", q)
        if key not in slot_of:
            slot_of[key] = len(first)
            first.append(q)
        slots.append(slot_of[key])
    return slots, first


def _check_layout(codes) -> None:
    """Raise EngineError unless each max_by/min_by by an exact ordering is followed by its
    ``by_key`` (and each ``by_key`` follows one)."""
    for q, code in enumerate(codes):
        if (code in _BY) != (q + 1 < len(codes) and codes[q + 1] == K.AGG_BY_KEY):
            raise EngineError(f"aggregation {q}: a max_by/min_by by an exact ordering "
                              "('max_by_l', 'max_by_s', ...) needs its 'by_key' right after it")
        if code == K.AGG_BY_KEY and (q == 0 or codes[q - 1] not in _BY):
            raise EngineError(f"aggregation {q} is a 'by_key' without its max_by/min_by before it")


def hll_words(p: int) -> int:
    """The int64 words of Spark's HLL++ buffer of ``2**p`` registers (ten 6-bit ones a word)."""
    return (1 << p) // 10 + 1


def aggregate_many(aggs, *, key=None, keys=None, pairs=False, B=None, WS=None, WA=None,
                   name=None, stamped=False, session_end=None) -> Operator:
    """Several windowed aggregations of the same tuples per key in one operator: one record per
    window holds every aggregation's state, so a tuple finds its window once and updates all.

    Parameters
    ----------
    aggs : list of (agg, value, value_type, other)
        Each as :func:`aggregate`'s arguments of those names; ``other`` is ``by`` for
        ``max_by``/``min_by``, else ``take``. Besides :func:`aggregate`'s, ``hll<p>`` (Spark's
        ``approx_count_distinct`` with ``2**p`` registers: ``value`` an int column of each
        tuple's 64-bit hash, Spark's ``xxhash64`` with seed 42; ``take`` its flags): each
        window keeps the registers in a row of the engine's register pool, outside its record
        (:mod:`~spark_stretch.engine.kernels`), and the output column is a 2-d array of the
        :func:`hll_words` words of each, Spark's buffer of ``HyperLogLogPlusPlus``. And
        ``min_s``/``max_s``: the least (greatest) string, ``value``
        an int column of interned ids, ``take`` its flags (0: a null), compared by the ranks
        the engine is given (:meth:`~spark_stretch.engine.Engine.order_strings`). And
        ``max_by_l``/``min_by_l`` (``_s``): ``max_by``/``min_by`` of the int ``value`` by an
        exact ordering, ``take`` its flags (0: a null ordering, skipped), followed by a
        ``by_key`` of the ordering column: int64 keys (``_l``, compared as ints) or interned
        strings (``_s``, by their ranks, as ``min_s``); ties: the last. And ``count_any``: the
        tuples counted in bits 0-47 of a word whose bits 48-62 are the or of the tuples' int
        ``value`` (a mask of up to 15 flags: the shim's "a non-null ``x``" of each column whose
        ``sum``, ``min`` or ``max`` needs only that, beside ``count(*)``); the output is the word.
    key, keys, pairs, B, WS, WA, stamped, session_end
        As for :func:`aggregate`, shared by all.

    The output has one column per aggregation, ``_0``, ``_1``, ... (after ``end`` for session
    windows), of the kind :func:`aggregate` gives it.

    Examples
    --------
    >>> op = aggregate_many([("sum", "v", "i", None), ("max", "v", "f", None), ("count", None, "f", None)],
    ...                     key="user", WS=10)
    >>> op.S, op.n_int, op.n_float, op.float_cols
    ((('_0', 'i'), ('_1', 'f'), ('_2', 'i')), 3, 1, (1,))
    """
    kw = dict(key=key, keys=keys, pairs=pairs, B=B, WS=WS, WA=WA, stamped=stamped,
              session_end=session_end)
    ops = [aggregate(a, value=v, value_type=vt, **kw, _fused=True,
                     **{"by" if a in ("max_by", "min_by") else "take": other})
           for a, v, vt, other in aggs]
    codes = [int(op.builtin_ip[2]) for op in ops]
    _check_layout(codes)
    # (the register pool: each HLL++'s words in a window's row, one after the other; their
    # first word after the aggregates' codes and columns in ip)
    pool, at = [], 0
    for q, code in enumerate(codes):
        if code >= K.AGG_HLL:
            pool.append((q, at, hll_words(code - K.AGG_HLL)))
            at += pool[-1][2]
    ip = np.full(K.MULTI + 5 * len(ops), -1, np.int64)
    ip[:8] = ops[0].builtin_ip[:8]
    ip[2], ip[8] = K.AGG_MULTI, len(ops)
    for q, first, _ in pool:
        ip[K.MULTI + 3 * len(ops) + q] = first
    reads_i = [c in _READS_I or c >= K.AGG_HLL for c in codes]
    reads_f = [c in _READS_F or c >= K.AGG_HLL for c in codes]
    values = [a[1] for a in aggs]
    slot_i, first_i = _value_slots(reads_i, [c in _PLAIN_I for c in codes], values)
    slot_f, first_f = _value_slots(reads_f, [c in _PLAIN_F for c in codes], values)
    ip[9], ip[10] = len(first_i), len(first_f)
    # (a float slot only for an aggregate that keeps a float: count, sum and max of ints none)
    floats = tuple(q for q, code in enumerate(codes) if uses_float(code))
    ip[K.MULTI + 4 * len(ops) + np.array(floats, np.int64)] = np.arange(len(floats))
    for q, code in enumerate(codes):
        ip[K.MULTI + 3 * q] = code
        ip[K.MULTI + 3 * q + 1] = slot_i[q]
        ip[K.MULTI + 3 * q + 2] = slot_f[q]
    asked = sorted({0, *first_i, *first_f})

    def prepare(stream, batch):
        # (the first operator's keys for all; only the first reader of a value column asked)
        parts = {q: ops[q].prepare(stream, batch, values_only=q > 0) for q in asked}
        # (column-major: value column k's rows at [k * n, (k + 1) * n), each copied whole;
        # interleaving them row by row would be a strided copy of every column)
        vi = np.concatenate([parts[q][3] for q in first_i]) if first_i else _EMPTY_I
        vf = np.concatenate([parts[q][2] for q in first_f]) if first_f else _EMPTY_F
        return (parts[0][0], parts[0][1], vf, vi) + tuple(parts[0][4:])

    at = 2 if session_end is not None else 0  # (an aggregate's init among a session's ints)
    # (a by_key's: the extremum of its max_by/min_by's ordering before any row)
    first_key = {K.AGG_MAXBY_L: int(_I64.min), K.AGG_MINBY_L: int(_I64.max)}
    inits = tuple(first_key.get(codes[q - 1], 0) if code == K.AGG_BY_KEY else
                  int(ops[q].init_i[at]) for q, code in enumerate(codes))
    ints = (0, 0) + inits if session_end is not None else inits + ((0,) if stamped else ())
    S = tuple((f"_{q}", op.S[-1][1]) for q, op in enumerate(ops))
    if session_end is not None:
        S = (("end", "i"),) + S
    return Operator(WA=ops[0].WA, WS=ops[0].WS, I=1, WT="multi", S=S, n_int=len(ints),
                    session_end=session_end, n_float=len(floats), init_i=ints,
                    init_f=tuple(float(ops[q].init_f[0]) for q in floats), builtin_ip=ip,
                    builtin_fp=np.zeros(1), prepare=prepare, decode=ops[0].decode,
                    name=name or " + ".join(op.name for op in ops), pool=tuple(pool),
                    float_cols=floats, checks_values=any(op.checks_values for op in ops))


def _take_flags(batch, take, n, vf, vi, value_type):
    if take is None:
        flags = np.ones(n, np.int64)
    elif take not in batch:
        raise EngineError(f"take column {take!r} is not an input column (columns: {sorted(batch)})")
    else:
        flags = np.asarray(batch[take])
    if value_type == "f":
        return vf, np.ascontiguousarray(flags, np.int64)
    return np.ascontiguousarray(flags, np.float64), vi


def count(**kw):
    """Windowed count per key; see :func:`aggregate`."""
    return aggregate("count", **kw)


def sum_(**kw):
    """Windowed sum per key; see :func:`aggregate`."""
    return aggregate("sum", **kw)


def min_(**kw):
    return aggregate("min", **kw)


def max_(**kw):
    return aggregate("max", **kw)


def mean(**kw):
    return aggregate("mean", **kw)


def longest(keys="hashtags", value="length", **kw):
    """Longest tweet per hashtag (Alg. 7 / Operator 9): max of ``value`` per element of ``keys``."""
    return aggregate("longest", keys=keys, value=value, **kw)
