"""Elastic ScaleGate (ESG): a multi-source, multi-reader buffer releasing tuples in timestamp order.

Sources add columnar batches; a tuple is *ready* once no source can still add an earlier one: each
source ``i`` has a frontier ``lo_i = max(last ts added (ordered sources only), watermark_i + 1)`` and
the tuples with ``ts < F = min_i lo_i`` are released, merged in the order ``(ts, tie columns..., source
id, order of addition)``, as one :class:`Segment` carrying the watermark ``W = F - 1``. Every reader gets
every released segment once (the same object: a multi-key tuple is stored once, whatever its number of
keys or readers). A data tuple with ``ts <= watermark`` of its source is late: it is dropped and
counted (``late_dropped``).

Two kinds of sources: *ordered* (the paper's model: timestamps non-decreasing, the last timestamp is an
implicit watermark; an earlier timestamp is an error) and *watermarked* (``ordered=False``, Spark's
model: a batch may hold any timestamps above the source's watermark; only explicit watermarks release).

API as in Table II of the paper: :meth:`ESG.add`, :meth:`ESG.get`, :meth:`ESG.add_sources`,
:meth:`ESG.remove_sources`, :meth:`ESG.add_readers`, :meth:`ESG.remove_readers`; plus
:meth:`ESG.add_watermark` / :meth:`ESG.advance_watermark` for explicit watermarks and
:meth:`ESG.add_control` for reconfiguration control tuples.

Examples
--------
>>> import numpy as np
>>> esg = ESG()
>>> esg.add_sources([0, 1]) and esg.add_readers([0])
True
>>> esg.add({"ts": np.array([1, 5]), "v": np.array([10, 50])}, 0)
>>> esg.add({"ts": np.array([3])    , "v": np.array([30])}, 1)
>>> [s.ts.tolist() for s in esg.get(0)]   # source 1 may still add ts 3
[[1]]
>>> esg.add_watermark(4, 1)
>>> [s.ts.tolist() for s in esg.get(0)]   # ready: ts < min(5, 4 + 1)
[[3]]
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from .batch import (ListColumn, _slice, batch_concat, batch_len, batch_take, normalize_batch,
                    sort_rows, to_arrow)
from .errors import EngineError
from .order import lexsort, merge_runs

__all__ = ["ESG", "Segment", "Control", "MIN_TS", "MAX_TS",
           # (the batch code's, imported from here before it had :mod:`.batch`)
           "ListColumn", "sort_rows", "to_arrow"]

MIN_TS = -(2 ** 62)
MAX_TS = 2 ** 62
_NO_TUPLES = np.empty(0, np.int64)  # (a rows_only segment's tuple positions)


def _instance(reader) -> bool:
    """Whether ``reader`` is an engine's instance (an int id), not a name such as "driver"."""
    return isinstance(reader, (int, np.integer))


@dataclass
class Segment:
    """Ready tuples released together, in timestamp order (in the order they came when the ESG
    is not ``in_order``), and the watermark after them.

    ``ts``, ``stream``, ``row``, ``seq`` have one entry per tuple in release order; ``parts[s]`` holds
    the columns of the tuples of input stream ``s`` (tuple ``i`` is ``parts[stream[i]]`` row
    ``row[i]``); ``seq`` is the tuple's rank in the ESG's total release order.
    """

    ts: np.ndarray
    stream: np.ndarray
    row: np.ndarray
    seq: np.ndarray
    parts: list
    watermark: int
    prev_watermark: int

    def __len__(self):
        return self.ts.shape[0]


@dataclass
class Control:
    """Reconfiguration control tuple (Alg. 5-6): new epoch, instance set and owner map, at event time gamma."""

    epoch: int
    instances: tuple
    owner_map: np.ndarray
    gamma: int
    barrier: object = None
    applied: threading.Event = field(default_factory=threading.Event)


class _Source:
    __slots__ = ("stream", "ordered", "last_ts", "wm", "chunks", "removed")

    def __init__(self, stream, ordered, wm):
        self.stream = stream
        self.ordered = ordered
        self.last_ts = MIN_TS
        self.wm = wm
        self.chunks = []
        self.removed = False

    def lo(self):
        return max(self.last_ts if self.ordered else MIN_TS, self.wm + 1)


class ESG:
    """Elastic ScaleGate; see the module docstring.

    Parameters
    ----------
    n_streams : int
        Number of input streams I (each source belongs to one stream, each stream has its own schema).
    tie_columns : tuple of str
        Columns breaking timestamp ties before the source id (``("key", "window_start", "_seq", "_sub")``
        for an operator's output ESG, so the order does not depend on which instance produced a row).
    interner : Interner, optional
        Interns string columns at :meth:`add`.
    """

    def __init__(self, name="esg", n_streams=1, tie_columns=(), interner=None):
        self.name = name
        self.n_streams = n_streams
        self.tie_columns = tuple(tie_columns)
        self.interner = interner
        self._lock = threading.Condition(threading.RLock())
        self._sources: dict[int, _Source] = {}
        self._readers: dict[int, int] = {}
        self._log: list = []
        self._log_base = 0
        self._schemas: dict[int, tuple] = {}
        self.watermark = MIN_TS
        self._rank = 0
        self.late_dropped = 0
        self.released = 0
        self.engine = None  # set by the runtime that owns this ESG
        self.dtypes = None  # optional {column: dtype} of the empty batch get_batch returns
        self.validate = None  # optional (stream, batch) -> None, raising EngineError on a bad batch
        # None: a tuple with ts <= watermark is late (the paper's model). (WA, WS): late only when
        # its last window has ended, ``(ts // WA) * WA + WS <= watermark`` (Spark's rule for window
        # aggregations); such a straggler updates only its windows that are still open. A
        # column name: late when that column (a session's end) is <= watermark.
        self.late_window = None
        # False: chunks are kept and released in the order they came, not by timestamp (a
        # reader that applies whole batches and fires at the watermark only: the engine's
        # ``apply_whole_batches``); a segment's tuples are then in no particular order.
        self.in_order = True
        # True: only get_batch reads it (no engine's instances): a segment's chunks are its
        # rows, with no tuple positions (stream, row, seq: empty). The engine's output ESG
        # under ``apply_whole_batches``: a close of millions of windows without 16 B a row more.
        self.rows_only = False

    # ---- sources ------------------------------------------------------------------------------
    def add_sources(self, sources, stream=0, ordered=True, watermark=None) -> bool:
        """Add sources (ids not yet sources); their watermark starts at the current one (Lemma 3).

        Returns True only if every id in ``sources`` was added.
        """
        if not 0 <= stream < self.n_streams:
            raise EngineError(f"stream={stream}; this ESG has I={self.n_streams} input streams (0..{self.n_streams - 1})")
        with self._lock:
            ok = True
            for s in sources:
                if s in self._sources and not self._sources[s].removed:
                    ok = False
                    continue
                wm = self.watermark if watermark is None else watermark
                self._sources[s] = _Source(stream, ordered, wm)
            self._release()
            return ok

    def remove_sources(self, sources) -> bool:
        """Remove sources: their pending tuples stay and become ready as the other sources advance."""
        with self._lock:
            ok = True
            for s in sources:
                src = self._sources.get(s)
                if src is None or src.removed:
                    ok = False
                    continue
                src.removed = True
            self._release()
            return ok

    def sources(self):
        with self._lock:
            return sorted(s for s, src in self._sources.items() if not src.removed)

    def _source(self, source):
        src = self._sources.get(source)
        if src is None or src.removed:
            state = "was removed" if src is not None else "is not a source"
            raise EngineError(f"source {source} {state} of ESG '{self.name}' "
                              f"(active sources: {self.sources()}); call add_sources([{source}]) first")
        return src

    # ---- readers ------------------------------------------------------------------------------
    def add_readers(self, readers, j=None) -> bool:
        """Add readers; they get next what reader ``j`` gets next (the log end if ``j`` is None)."""
        with self._lock:
            if self.rows_only and any(map(_instance, readers)):
                raise EngineError(f"ESG '{self.name}' gives its rows only (an engine applying "
                                  "whole batches): an engine's instances cannot read it")
            pos = self._log_base + len(self._log) if j is None else self._readers[j]
            ok = True
            for r in readers:
                if r in self._readers:
                    ok = False
                    continue
                self._readers[r] = pos
            return ok

    def give_rows_only(self) -> bool:
        """Make the ESG :attr:`rows_only` unless an engine's instances read it (then its
        segments keep their tuple positions). Returns whether it is."""
        with self._lock:
            self.rows_only = not any(map(_instance, self._readers))
            return self.rows_only

    def remove_readers(self, readers) -> bool:
        with self._lock:
            ok = all(r in self._readers for r in readers)
            for r in readers:
                self._readers.pop(r, None)
            self._gc()
            return ok

    def readers(self):
        with self._lock:
            return sorted(self._readers)

    # ---- add ----------------------------------------------------------------------------------
    def add(self, batch, source, presorted=False) -> None:
        """Add a batch of tuples (RecordBatch, Table or dict of arrays with an int64 'ts' column) from ``source``.

        ``presorted=True`` (internal): the batch is already in ``(ts, tie columns)`` order.
        """
        b = batch if presorted else normalize_batch(batch, self.interner)
        with self._lock:
            src = self._source(source)
            self._check_schema(src.stream, b)
            if self.validate is not None:
                self.validate(src.stream, b)
            ts = b["ts"]
            if ts.shape[0] == 0:
                return
            if self.late_window is None:
                late = ts <= src.wm
            elif isinstance(self.late_window, str):  # a session window: late when it ended
                late = b[self.late_window] <= src.wm
            else:  # Spark's rule: late only when every window of the tuple has ended
                late = ts < _first_open(int(src.wm), *self.late_window)
            if late.any():
                self.late_dropped += int(late.sum())
                b = batch_take(b, np.flatnonzero(~late))
                ts = b["ts"]
                if ts.shape[0] == 0:
                    return
            if src.ordered:
                if ts[0] < src.last_ts or (ts.shape[0] > 1 and (np.diff(ts) < 0).any()):
                    bad = ts[0] if ts[0] < src.last_ts else ts[1:][np.diff(ts) < 0][0]
                    raise EngineError(f"out-of-order timestamp {int(bad)} from ordered source {source} of ESG "
                                      f"'{self.name}' (its last timestamp is {max(int(src.last_ts), int(ts[0]))}); "
                                      "an ordered source must add non-decreasing timestamps, or add it with "
                                      "ordered=False and explicit watermarks")
            if not presorted and self.in_order and (not src.ordered or self.tie_columns):
                b = self._sorted(b)  # every chunk sorted by (ts, tie columns): _merge merges them
            src.chunks.append(b)
            src.last_ts = max(src.last_ts, int(b["ts"][-1]) if src.ordered else int(b["ts"].max()))
            self._release()

    def _sorted(self, b):
        ts = b["ts"]
        if not self.tie_columns:
            if ts.shape[0] > 1 and (np.diff(ts) < 0).any():
                return batch_take(b, np.argsort(ts, kind="stable"))
            return b
        return batch_take(b, sort_rows(b, self.tie_columns))

    def _check_schema(self, stream, b):
        names = tuple(b)
        have = self._schemas.setdefault(stream, names)
        if have != names:
            raise EngineError(f"batch columns {list(names)} differ from stream {stream}'s schema {list(have)} "
                              f"in ESG '{self.name}'")

    def set_schema(self, stream, columns, dtypes=None):
        """Declare a stream's columns (``ts`` first) before any batch arrives."""
        with self._lock:
            self._schemas[stream] = tuple(columns)
            if dtypes:
                self.dtypes = dict(dtypes)

    def add_watermark(self, ts, source) -> None:
        """Explicit watermark of ``source``: it will add no tuple with timestamp <= ``ts``."""
        with self._lock:
            src = self._source(source)
            src.wm = max(src.wm, int(ts))
            self._release()

    def advance_watermark(self, ts) -> None:
        """Explicit watermark ``ts`` for every source (Spark's global watermark)."""
        with self._lock:
            for src in self._sources.values():
                src.wm = max(src.wm, int(ts))
            self._release()

    def add_control(self, control: Control) -> None:
        """Append a control tuple at the current position: after every released tuple, before all others."""
        with self._lock:
            control.gamma = self.watermark
            self._log.append(control)
            self._lock.notify_all()

    # ---- release ------------------------------------------------------------------------------
    def frontier(self):
        live = [s.lo() for s in self._sources.values() if not s.removed]
        return min(live) if live else None

    def release_all(self) -> None:
        """Release every tuple added so far, under the current watermark: a batch applied
        whole (Spark's update and complete output modes), closing no window it does not close."""
        with self._lock:
            self._release(MAX_TS, self.watermark)

    def _release(self, F=None, W=None):
        if F is None:
            F = self.frontier()
        if F is None:
            if not any(s.chunks for s in self._sources.values()):
                return
            F = MAX_TS
        ids = sorted(self._sources)
        per_stream = [[] for _ in range(self.n_streams)]
        for sid in ids:
            src = self._sources[sid]
            keep = []
            for ch in src.chunks:
                if not self.in_order:
                    _split(ch, F, per_stream[src.stream], keep)
                    continue
                cut = int(np.searchsorted(ch["ts"], F, side="left"))
                if cut == len(ch["ts"]):
                    per_stream[src.stream].append(ch)
                elif cut == 0:
                    keep.append(ch)
                else:
                    per_stream[src.stream].append({k: _slice(v, 0, cut) for k, v in ch.items()})
                    keep.append({k: _slice(v, cut, len(ch["ts"])) for k, v in ch.items()})
            src.chunks = keep
            if src.removed and not keep:
                del self._sources[sid]
        n_parts = sum(len(p) for p in per_stream)
        if W is None:
            W = F - 1 if F < MAX_TS else max(self.watermark, max(
                (int(p["ts"][-1]) for ps in per_stream for p in ps), default=self.watermark))
        if n_parts == 0 and W <= self.watermark:
            return
        if not self.in_order and self.n_streams == 1:  # (chunks as they came, never joined:
            for ch in per_stream[0][:-1]:              # one segment each, the last moves W)
                self._log.append(self._merge([[ch]], self.watermark))
            per_stream = [per_stream[0][-1:]]
        seg = self._merge(per_stream, max(W, self.watermark))
        self.watermark = seg.watermark
        self._log.append(seg)
        self._lock.notify_all()

    def _merge(self, per_stream, W):
        batches = [batch_concat(p) if p else None for p in per_stream]
        lens = [0 if b is None else batch_len(b) for b in batches]
        n = sum(lens)
        if n == 0:
            e = np.empty(0, np.int64)
            return Segment(e, e, e, e, [None] * self.n_streams, W, self.watermark)
        # (one chunk; or one stream's chunks as they came, not in_order: taken as they are)
        if len(per_stream[0]) == n_single(per_stream) == 1 or (self.n_streams == 1
                                                                 and not self.in_order):
            b = batches[0]
            if self.rows_only:
                self._rank += n
                self.released += n
                return Segment(b["ts"], _NO_TUPLES, _NO_TUPLES, _NO_TUPLES, batches, W,
                               self.watermark)
            ts, stream, row = b["ts"], np.zeros(n, np.int64), np.arange(n, dtype=np.int64)
            parts = batches
        elif self.n_streams == 1:  # one stream (an operator's output): merge its sorted chunks
            b = batches[0]
            bounds = np.cumsum([0] + [len(ch["ts"]) for ch in per_stream[0]])
            perm = merge_runs([b["ts"]] + [b[c] for c in self.tie_columns], bounds)
            parts = [batch_take(b, perm)]
            ts, stream, row = parts[0]["ts"], np.zeros(n, np.int64), np.arange(n, dtype=np.int64)
        else:
            g_ts = np.concatenate([b["ts"] for b in batches if b is not None])
            g_stream = np.concatenate([np.full(L, s, np.int64) for s, L in enumerate(lens) if L])
            g_local = np.concatenate([np.arange(L, dtype=np.int64) for L in lens if L])
            if self.tie_columns:
                perm = lexsort([g_ts] + [np.concatenate([p[c] for p in per_stream[0]]) for c in self.tie_columns])
            else:
                perm = np.argsort(g_ts, kind="stable")
            ts, stream, loc = g_ts[perm], g_stream[perm], g_local[perm]
            row = np.empty(n, np.int64)
            parts = []
            for s in range(self.n_streams):
                m = stream == s
                cnt = int(m.sum())
                row[m] = np.arange(cnt, dtype=np.int64)
                parts.append(batch_take(batches[s], loc[m]) if cnt else None)
        seq = np.arange(self._rank, self._rank + n, dtype=np.int64)
        self._rank += n
        self.released += n
        return Segment(ts, stream, row, seq, parts, W, self.watermark)

    # ---- get ----------------------------------------------------------------------------------
    def get(self, j, block=False, timeout=None, stop_at_control=True) -> list:
        """Next released items (Segments and Controls) for reader ``j``, up to and including a Control."""
        with self._lock:
            if j not in self._readers:
                raise EngineError(f"reader {j} is not a reader of ESG '{self.name}' (readers: {self.readers()})")
            if block:
                self._lock.wait_for(lambda: j not in self._readers or
                                    self._readers[j] < self._log_base + len(self._log), timeout)
                if j not in self._readers:
                    return []
            a = self._readers[j] - self._log_base
            items = self._log[a:]
            if stop_at_control:
                for i, it in enumerate(items):
                    if isinstance(it, Control):
                        items = items[:i + 1]
                        break
            self._readers[j] += len(items)
            self._gc()
            return items

    def pending_for(self, j) -> int:
        """Tuples (and controls) not yet read by reader ``j``; 0 once ``j`` is no reader (a
        free-running instance may leave in an epoch switch while the caller asks)."""
        with self._lock:
            pos = self._readers.get(j)
            return 0 if pos is None else self._log_base + len(self._log) - pos

    def _gc(self):
        if not self._readers:
            return
        lo = min(self._readers.values()) - self._log_base
        if lo > 0:
            del self._log[:lo]
            self._log_base += lo

    def get_batch(self, j, format="dict", chunks=False):
        """All released rows for reader ``j`` as one columnar batch (``dict`` or ``"arrow"``), and the watermark.

        Only for single-stream ESGs (an operator's output). Control tuples are skipped. With
        ``chunks``, a list of batches (dicts), as released, not joined into one (no rows: one
        empty batch).
        """
        items = self.get(j, stop_at_control=False)
        segs = [it for it in items if isinstance(it, Segment) and len(it)]
        with self._lock:
            wm = self.watermark
            cols = self._schemas.get(0)
        if chunks and segs:
            return [s.parts[0] for s in segs], wm
        if segs:
            batch = batch_concat([s.parts[0] for s in segs])
        else:
            dt = self.dtypes or {}
            batch = {c: np.empty(0, dt.get(c, np.int64)) for c in (cols or ("ts",))}
        if chunks:  # (no rows: one empty batch, so a reader always has the columns)
            return [batch], wm
        return (to_arrow(batch) if format == "arrow" else batch), wm

    # ---- snapshot -----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            return {"sources": {s: (src.stream, src.ordered, src.last_ts, src.wm, list(src.chunks), src.removed)
                                for s, src in self._sources.items()},
                    "readers": dict(self._readers), "log": list(self._log), "log_base": self._log_base,
                    "schemas": dict(self._schemas), "watermark": self.watermark, "rank": self._rank,
                    "late_dropped": self.late_dropped, "released": self.released}

    def restore(self, snap: dict) -> None:
        with self._lock:
            self._sources = {}
            for s, (stream, ordered, last_ts, wm, chunks, removed) in snap["sources"].items():
                src = _Source(stream, ordered, wm)
                src.last_ts, src.chunks, src.removed = last_ts, list(chunks), removed
                self._sources[s] = src
            self._readers = dict(snap["readers"])
            self._log = list(snap["log"])
            self._log_base = snap["log_base"]
            self._schemas = dict(snap["schemas"])
            self.watermark = snap["watermark"]
            self._rank = snap["rank"]
            self.late_dropped = snap["late_dropped"]
            self.released = snap["released"]


def _first_open(wm: int, WA: int, WS: int) -> int:
    """The least timestamp whose last window (the one starting at ``ts // WA * WA``) is open at
    watermark ``wm``: a tuple below it has every window ended (one comparison per tuple, not
    a division), clamped to int64."""
    t = ((wm - WS) // WA + 1) * WA  # (q * WA + WS <= wm  <=>  q <= (wm - WS) // WA)
    return min(max(t, -2 ** 63), 2 ** 63 - 1)


def n_single(per_stream):
    return sum(len(p) for p in per_stream)


def _split(ch, F, out, keep) -> None:
    """Chunk ``ch`` (in no order) split by timestamp: ``ts < F`` to ``out``, the rest to ``keep``."""
    ready = ch["ts"] < F
    n = int(np.count_nonzero(ready))
    if n == len(ready):
        out.append(ch)
    elif n == 0:
        keep.append(ch)
    else:
        out.append(batch_take(ch, np.flatnonzero(ready)))
        keep.append(batch_take(ch, np.flatnonzero(~ready)))
