"""The built-in aggregations of a ``stretchAggregate`` or ``stretch(df)`` query: their engine
operators, the input rows they refuse, and their values read from the engine's state."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine import ListColumn
from ..ops.aggregate import aggregate, aggregate_many
from ..protocol.errors import InputRejected, StateError
from ..protocol.specs import AggregateSpec
from .columns import KeyCodec, finish, list_parts, window_array, window_struct

__all__ = ["add_sources", "builtin_operators", "check_checkpoint", "engine_agg", "engine_columns", "output_table", "per_aggregation", "rank_strings",
           "reject_nulls", "state_output", "key_encoding", "check_keys", "whole_batches"]


def builtin_operators(s: AggregateSpec) -> list:
    """One built-in engine operator per aggregation of the spec."""
    kw = dict(session_end="end") if s.session_end else dict(WS=s.window_us, WA=s.slide_us)
    if s.key_kind == "scalar":
        kw["key"] = "key"
    else:
        kw["keys"] = "key"
        if s.key_kind == "pairs":
            kw["pairs"], kw["B"] = True, s.distance
    kw["stamped"] = s.output_mode != "append"
    aggs = [(_of_strings(s, fn, col), col,
             "i" if col is not None and s.value_types[col] != "double" else "f", take)
            for fn, col, take in map(engine_agg, s.aggs)]
    if _fused(s):  # one record per window for all aggregations
        return [aggregate_many(aggs, **kw)]
    (fn, col, vt, other), = aggs
    return [aggregate(fn, value=col, value_type=vt, **kw,
                      **{"by" if fn in ("max_by", "min_by") else "take": other})]


def _of_strings(s: AggregateSpec, fn: str, col) -> str:
    """The engine's aggregate: a min or max of a string column its ``min_s``/``max_s``."""
    return f"{fn}_s" if fn in ("min", "max") and s.value_types.get(col) == "string" else fn


def _fused(s: AggregateSpec) -> bool:
    """Whether the spec's aggregations run in one ``aggregate_many`` operator: several, or one
    that only runs there (a min or max of strings, an approx_count_distinct)."""
    return len(s.aggs) > 1 or _ranks_strings(s) or _hll(engine_agg(s.aggs[0])[0])


def _hll(fn: str) -> bool:
    """Whether the engine's aggregate ``fn`` is an approx_count_distinct's (``hll<p>``)."""
    return fn[:3] == "hll" and fn[3:].isdigit()


def _ranks_strings(s: AggregateSpec) -> bool:
    return isinstance(s, AggregateSpec) and any(  # (an engine operator's spec ranks none)
        _of_strings(s, *engine_agg(a)[:2]).endswith("_s") for a in s.aggs)


def rank_strings(s: AggregateSpec, codec: KeyCodec, engines: list) -> None:
    """Give ``engines`` the order of the strings interned so far, if ``s`` has a min or max
    of strings and strings were added (``Engine.order_strings``; before a step or flush)."""
    if _ranks_strings(s) and any(e.strings_ranked != len(codec.interner) for e in engines):
        ranks = codec.ranks()
        for eng in engines:
            eng.order_strings(ranks)


def add_sources(engines, spec) -> None:
    """A new query's input sources, source s feeding stream s, at the watermark Spark's starts
    at: 0, so that a window ending by then is late; but for time windows in complete mode Spark
    drops no row as late (None: the ESG's minimum)."""
    complete = getattr(spec, "output_mode", "append") == "complete"
    start = None if complete and not getattr(spec, "session_end", None) else 0
    for eng in engines:
        for s in range(eng.op.I):
            eng.esg_in.add_sources([s], stream=s, ordered=False, watermark=start)


def whole_batches(engines, spec) -> None:
    """In append mode, engines whose aggregates are order-free apply each batch whole, as Spark
    does (no event-time sort, no row held back: ``Engine.apply_whole_batches``); their rows
    come out in no particular order, unless several engines' rows must line up."""
    if getattr(spec, "output_mode", "append") == "append":
        for eng in engines:
            eng.apply_whole_batches(ordered_output=len(engines) > 1)


def engine_columns(s: AggregateSpec, codec: KeyCodec, share, table: pa.Table) -> dict:
    """A batch's engine columns (``ts``, ``key``, the values; ``end`` of a session): keys and
    string values as the ids ``codec`` interns, pair keys flagged by this host's ``share`` (a
    :class:`~.share.KeyShare`, or None on one host)."""
    if s.drop_null_ts and table.column(s.ts_column).null_count:
        table = table.filter(pc.is_valid(table.column(s.ts_column)))
    if s.session_end:  # (Spark's filter: a row without a positive gap is in no session)
        ts, end = (pc.cast(table.column(c), pa.int64()) for c in (s.ts_column, s.session_end))
        keep = pc.fill_null(pc.greater(end, ts), False)
        if not pc.all(keep).as_py():
            table = table.filter(keep)
    cols = {"ts": pc.cast(table.column(s.ts_column), pa.int64()).to_numpy()}
    if s.session_end:
        cols["end"] = pc.cast(table.column(s.session_end), pa.int64()).to_numpy()
    key = table.column(s.key_column).combine_chunks()
    if s.key_kind == "scalar":
        cols["key"] = codec.key_ids(key) if s.key_nullable else codec.ids(key)
    else:
        offsets, values = list_parts(key)
        ids = codec.ids(values, force_intern=s.key_kind == "pairs")
        if s.key_kind == "pairs" and share is not None:
            ids = share.flag_firsts(ids, values)
        cols["key"] = ListColumn(offsets, ids)
    for c, vt in s.value_types.items():
        if vt == "string":  # (a first/last/max_by/min_by value: its id, decoded on output)
            cols[c] = codec.ids(table.column(c).combine_chunks(), force_intern=True)
        else:
            cols[c] = pc.cast(table.column(c), pa.int64() if vt == "long" else pa.float64()
                              ).to_numpy()
    return cols


def output_in_blocks(spec, codec, engines) -> Optional[pa.Table]:
    """The query's rows from one engine's output blocks (whole batches), each let go once made
    rows: a close of millions of windows is never whole twice; and the tables it left nearly
    empty shrink first (``Engine.shrink_sparse_tables``): never the tables, the blocks and the
    rows at once. None: ordered rows."""
    if len(engines) > 1 or engines[0].esg_out.in_order:
        return None
    engines[0].shrink_sparse_tables()
    blocks = engines[0].esg_out.get_batch("driver", chunks=True)[0]
    blocks.reverse()  # (taken from the end: each block is let go as it is made rows)
    tables = []
    while blocks:
        tables.append(output_table(spec, codec, per_aggregation(spec, [blocks.pop()])))
    return pa.concat_tables(tables)


SLICE_ROWS = 1 << 16
"""Rows of a batch applied at a time by engines that apply whole batches (:func:`slice_rows`):
what a slice holds while it is applied (its columns, ESG segment, kernel arrays) is a
quarter of what 262,144 rows held: 5M keys, 2-6 B a live window less, in the same time
(12.0-12.1 s against 11.7-12.9 s, alternately on 2026-12-06; 8% more on 2026-12-05, before
the Parquet reader read one column at a time; BENCHMARKS.md, aggregation state at scale)."""


def slice_rows(s: AggregateSpec, engines: list) -> int:
    """Rows of a batch that ``engines`` apply at a time (``Engine.release_all`` after each
    slice), or 0: the batch at once. Slices when every engine applies whole batches (set up in
    append mode only, for order-free aggregates over time windows: no session, no ordered
    aggregate; windows fired by the watermark only, which does not move between slices) and
    no aggregate ranks strings (ranked once a batch, before its rows apply): the state is the
    same as the batch applied at once, and a batch's engine columns, ESG segment and kernel
    arrays are held for one slice at a time (BENCHMARKS.md, aggregation state at scale)."""
    if _ranks_strings(s) or not all(e.applies_whole_batches for e in engines):
        return 0
    return SLICE_ROWS


def per_aggregation(s: AggregateSpec, outs: list) -> list:
    """The engines' outputs (or state rows ``(rec, acc_f, words)``, ``Engine.state_rows``) one
    per aggregation of ``s``: a fused operator's (:func:`builtin_operators`) split into one per
    aggregation (an approx_count_distinct's state rows: its words in place of ``acc_f``)."""
    if isinstance(outs[0], tuple):  # state rows: aggregation q in int slot q, float slot q
        # (a session's record: key, l, start, end, accumulators; as a window's, its end last)
        at, cols = (4, [0, 2]) if s.session_end else (2, [0, 1])
        return [(np.concatenate([rec[:, cols + [at + q] + [3] * bool(s.session_end)]
                                 for rec, *_ in outs]),
                 np.concatenate([words[q] if q in words else acc[:, [q]]
                                 for _, acc, words in outs])) for q in range(len(s.aggs))]
    if not _fused(s):
        return outs
    (out,) = outs
    common = {c: out[c] for c in ("key", "window_start", "end") if c in out}
    return [{**common, fn: out[f"_{q}"]} for q, (fn, _, _) in enumerate(map(engine_agg, s.aggs))]


def engine_agg(a) -> tuple:
    """``(fn, column, other)`` of one aggregation of a spec: ``first_if``/``last_if`` (a row
    counts where the take column ``other`` is not 0) are the engine's ``first``/``last`` with
    ``take``; ``max_by``/``min_by`` order by the column ``other``; ``hll<p>`` is an
    ``approx_count_distinct`` (its output: Spark's buffer words); ``max_by_l``/``max_by_s`` (``min_``) a
    ``max_by`` by an exact ordering, which the aggregation ``by<q>`` after it (the engine's
    ``by_key``, of the aggregation q before it) reads (``ops.aggregate_many``)."""
    fn, col, take = (*a, None)[:3]
    if fn[:2] == "by" and fn[2:].isdigit():
        return "by_key", col, take
    return (fn[:-3] if fn.endswith("_if") else fn), col, take


def _is_long(s: AggregateSpec, fn: str, col) -> bool:
    """Whether the aggregate's state and output are ints (a string value: its interned id)."""
    return fn == "count" or (fn != "mean" and s.value_types[col] != "double")


def check_checkpoint(mode: str, meta: dict, batch: int, kept: int, running: int) -> None:
    """Raise StateError if the engine checkpoint of ``batch`` (its ``meta``, ``kept`` engine
    snapshots) cannot continue in this run (output mode ``mode``, ``running`` engines): its
    windows kept otherwise (update and complete stamp them, append does not), or one engine
    per aggregation (before they were fused)."""
    was = meta.get("output_mode", "append")
    if (mode == "append") != (was == "append"):
        raise StateError(f"the engine state of batch {batch} was kept in output mode {was}, "
                         f"which keeps windows otherwise than output mode {mode}: restart "
                         f"the query in output mode {was}, or from a new checkpoint location")
    if kept != running:
        raise StateError(f"the engine checkpoint of batch {batch} keeps {kept} engines, this "
                         f"version runs {running} (one for all aggregations): restart the "
                         "query from a new checkpoint location")


def key_encoding(s: AggregateSpec) -> Optional[str]:
    """How the engine keeps this query's keys (a checkpoint records it): ``kind:type``, ``?``
    after a nullable scalar key column's type (its values, the null key one of them); None for
    an engine operator's query (its keys are the operator's)."""
    if not isinstance(s, AggregateSpec):
        return None
    return f"{s.key_kind}:{s.key_type}{'?' if s.key_nullable else ''}"


def check_keys(s: AggregateSpec, meta: dict, batch: int) -> None:
    """Raise StateError if the engine checkpoint of ``batch`` keeps its keys otherwise than
    this run would: a checkpoint with no record of it was written before a nullable key column
    became the engine's key (it kept such a column as interned bytes of Spark's row)."""
    now = key_encoding(s)
    if now is None:
        return
    was = meta.get("keys", now if not s.key_nullable else f"{s.key_kind}:binary")
    if was != now:
        raise StateError(
            f"the engine checkpoint of batch {batch} keeps the keys of column "
            f"'{s.key_column}' as {was}, this version as {now} (a nullable key column's values "
            "are its keys): finish the query with the version that wrote the "
            "checkpoint, or restart it from a new checkpoint location")


def reject_nulls(s: AggregateSpec, table: pa.Table, batch: int) -> None:
    """Raise InputRejected, naming the column, for rows the aggregations cannot take: a null
    event time, key or aggregated value."""
    ts = table.column(s.ts_column)
    if ts.null_count and not s.drop_null_ts:
        raise InputRejected(f"event-time column '{s.ts_column}' has {ts.null_count} nulls in "
                            f"batch {batch}")
    key = table.column(s.key_column)
    # a null list is no key (as explode); a null element of one would be a null key
    # (a nullable scalar key column's nulls are the null key, Spark's null group)
    nulls = (0 if s.key_nullable else key.null_count) if s.key_kind == "scalar" \
        else pc.list_flatten(key).null_count
    if nulls:
        col = s.key_column
        raise InputRejected(
            f"keys column '{col}' has {nulls} null keys in batch {batch}; "
            "stretchAggregate does not group nulls (Spark would make a null group): filter "
            f"them first, e.g. df.where(F.col('{col}').isNotNull())")
    for c in s.value_types:
        if table.column(c).null_count:
            raise InputRejected(f"agg column '{c}' has {table.column(c).null_count} nulls in "
                                f"batch {batch}; stretchAggregate needs non-null values "
                                "(fill or filter them)")


def state_output(s: AggregateSpec, rec: np.ndarray, acc: np.ndarray, fn: str, col) -> dict:
    """One aggregation's windows read from its state (``Engine.state_rows``, through
    :func:`per_aggregation`), as the columns its engine operator outputs, in (key, window
    start) order."""
    order = np.lexsort((rec[:, 1], rec[:, 0]))
    rec, acc = rec[order], acc[order]
    fn, col, _ = engine_agg((fn, col))
    if _hll(fn):  # (its words, per_aggregation)
        v = acc
    elif fn == "mean":
        v = acc[:, 0] / rec[:, 2]
    elif _is_long(s, fn, col):
        v = rec[:, 2]
    else:
        v = acc[:, 0]
    out = {"key": rec[:, 0], "window_start": rec[:, 1], fn: v}
    if s.session_end:
        out["end"] = rec[:, 3]
    return out


def output_table(s: AggregateSpec, codec: KeyCodec, outs: list) -> pa.Table:
    """The engines' outputs (one per aggregation of ``s``, rows in the same order) as the
    query's rows: window, key (decoded with ``codec``), aggregates, then ``s.finish``."""
    out = outs[0]
    for other in outs[1:]:  # same tuples, same windows: the rows must line up one to one
        if not (np.array_equal(other["key"], out["key"])
                and np.array_equal(other["window_start"], out["window_start"])):
            raise RuntimeError("aggregation outputs out of step (engine bug)")
    window = (window_array(out["window_start"], s.window_us) if s.session_end is None else
              window_struct(out["window_start"], out["end"]))
    arrays = [window, _decode_keys(s, codec, np.asarray(out["key"], np.int64))]
    names = ["window", "key"]
    for (fn, col, _), name, o in zip(map(engine_agg, s.aggs), s.output_names(), outs):
        v = np.asarray(o[fn])
        if _hll(fn):
            arrays.append(_words(v))
        elif fn != "count" and s.value_types[col] == "string":
            arrays.append(codec.strings(v.astype(np.int64)))
        elif _is_long(s, fn, col):
            arrays.append(pa.array(v.astype(np.int64)))
        else:
            arrays.append(pa.array(v.astype(np.float64)))
        names.append(name)
    table = pa.Table.from_arrays(arrays, names=names)
    return table if s.finish is None else finish(table, s.finish)


def _words(v: np.ndarray) -> pa.ChunkedArray:
    """An approx_count_distinct's words (a row each) as binary values: Spark's HLL++ buffer,
    the shim's ``StretchHll`` reads it (little-endian longs); chunks of up to 1 GiB (a binary
    array's offsets are 32-bit)."""
    if v.ndim < 2:  # (no rows)
        return pa.chunked_array([], pa.binary())
    v = np.ascontiguousarray(v, "<i8")
    size = v.shape[1] * 8
    rows = max(1, (1 << 30) // size)
    return pa.chunked_array([pa.Array.from_buffers(pa.binary(), len(c), [
        None, pa.py_buffer(np.arange(len(c) + 1, dtype=np.int32) * size), pa.py_buffer(c)])
        for c in (v[a:a + rows] for a in range(0, len(v), rows))], pa.binary())


def _decode_keys(s: AggregateSpec, codec: KeyCodec, keys: np.ndarray) -> pa.Array:
    if s.key_type == "binary":
        return codec.binaries(keys)
    strings = s.key_type == "string"
    decode = codec.strings if strings else codec.longs
    if s.key_kind == "pairs":
        return pa.StructArray.from_arrays([decode(keys >> 32), decode(keys & 0xFFFFFFFF)],
                                          names=["_1", "_2"])
    if s.key_nullable:
        return codec.key_values(keys, s.key_type)
    return decode(keys) if strings else pa.array(keys, pa.int64())
