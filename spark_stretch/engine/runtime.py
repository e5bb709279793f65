"""setup / reconfigure / drain: n instances over shared buckets, m of them active (stretch-tpds §5, §7).

Two ways to drive the engine, over the same kernels and state:

(b) synchronously (what a micro-batch driver calls every batch)::

    eng = Engine(op, m=2, n=4)
    eng.esg_in.add(batch, source=0)          # columnar batch, int64 'ts'
    eng.esg_in.advance_watermark(w)          # windows with end <= w are emitted
    eng.drain()                              # blocks until all that became ready is processed
    out, wm = eng.esg_out.get_batch("driver")   # ts-ordered results (dict of numpy, or format="arrow")

(a) free-running worker threads as in the paper: ``eng.start()``; sources add; instance threads get
ready segments from ESG_in, process them, add results to ESG_out; ``eng.drain()`` waits until idle;
``eng.stop()``.

Each instance runs the nogil kernel over the whole ready segment (every tuple, stored once) and updates
only the buckets the owner map gives it, writing its own output block; blocks are merged in
``(ts, key, window_start, _seq, _sub)`` order by ESG_out, so the output does not depend on m or on the
owner map. A reconfiguration is a control tuple in ESG_in: instances process everything before it under
the old owner map, meet at a barrier, and go on under the new one (no state is copied).

This module has the engine's step loop (:meth:`Engine.drain` over ready segments, each
instance's kernel run, its output block) and its free-running threads; an :class:`Engine` is
also :class:`~spark_stretch.engine.epochs.Epochs` (reconfiguration: epochs, control tuples,
owner maps) and :class:`~spark_stretch.engine.snapshot.Snapshots` (checkpoints: snapshot and
restore).
"""
from __future__ import annotations

import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from . import kernels as K
from .buckets import cap_for, loaded
from .batch import _slice, frozen, sort_rows, to_arrow
from .epochs import Epochs, _check_mn
from .errors import EngineError
from .esg import ESG, Control
from .meter import Meter
from .snapshot import Snapshots
from .state import BucketState, Interner, RWLock, balanced_owner_map

# aggregates whose result does not depend on the order of the tuples (apply_whole_batches); a
# double sum's (and mean's) last bits do, as Spark's own do on the order its partitions merge in
_ORDER_FREE = frozenset({K.AGG_COUNT, K.AGG_SUM_I, K.AGG_MIN_I, K.AGG_MAX_I, K.AGG_SUM_F,
                         K.AGG_MEAN, K.AGG_COUNT_ANY})

OUT_TIES = ("key", "window_start", "_seq", "_sub")


def _fused_codes(ip) -> list:
    """The aggregate codes of a fused built-in aggregation (``aggregate_many``), else []."""
    return [int(ip[K.MULTI + 3 * q]) for q in range(int(ip[8]))] if ip[2] == K.AGG_MULTI else []


INLINE_ROWS = 4096  # segments smaller than this run the instances one after another on the caller thread
# output rows an instance gathers before it hands them out as a block, when their order does not
# matter (whole batches): a window close of millions of windows never builds them in one piece
OUT_CHUNK_ROWS = 1 << 18
# tables smaller than this are not worth shrinking after a close (Engine.shrink_sparse_tables)
SHRINK_BYTES = 32 << 20


class Instance:
    """One O+ instance o_j: its output block, resume position and key buffer (all instance-local)."""

    def __init__(self, j, op, cap=1024):
        self.id = j
        self.n_oi, self.n_of = op.n_out_int, op.n_out_float
        self._alloc(cap)
        self.opos = np.zeros(1, np.int64)
        self.resume = np.zeros(6, np.int64)  # (4, 5: tuples, buckets between page drops)
        self.keybuf = np.empty(64, np.int64)
        # the pool words of its output rows before ``gathered_to`` (their windows' rows are
        # free to be taken again; the rows after it hold pool rows: ``Engine._refill_pool``)
        self.gathered, self.gathered_to = [], 0

    def _alloc(self, cap):
        self.o_ts = np.empty(cap, np.int64)
        self.o_key = np.empty(cap, np.int64)
        self.o_l = np.empty(cap, np.int64)
        self.o_seq = np.empty(cap, np.int64)
        self.o_sub = np.empty(cap, np.int64)
        self.o_i = np.zeros((cap, self.n_oi), np.int64)
        self.o_f = np.zeros((cap, self.n_of), np.float64)

    def grow_out(self):
        old = [self.o_ts, self.o_key, self.o_l, self.o_seq, self.o_sub, self.o_i, self.o_f]
        self._alloc(self.o_ts.shape[0] * 2)
        p = int(self.opos[0])
        for dst, src in zip([self.o_ts, self.o_key, self.o_l, self.o_seq, self.o_sub, self.o_i, self.o_f], old):
            dst[:p] = src[:p]


class Engine(Epochs, Snapshots):
    """A VSN-parallel, elastic O+ operator: ``setup(O+, m, n)`` of the paper.

    Parameters
    ----------
    op : Operator
        The O+ operator (see :mod:`spark_stretch.ops` for built-ins).
    m, n : int
        Initial and maximum parallelism; n instances are created, n - m wait in the pool.
    n_buckets : int
        B, the number of state buckets (much larger than n).
    esg_in : ESG, optional
        An upstream operator's ``esg_out`` to read from (composition); default: a new ESG whose sources
        the caller adds (``esg_in.add_sources``).
    threads : bool
        Run the m instances of a large segment on m threads (nogil kernels); False: one after another.
    inline_rows : int
        Segments with fewer tuples run their instances one after another on the calling thread (lower
        fixed cost per :meth:`drain`); 0: always use the threads.
    lateness : {"tuple", "window"}
        ``"tuple"`` (the paper's model): a tuple with ``ts <= watermark`` is late and dropped.
        ``"window"`` (Spark's rule for window aggregations): a tuple is late only when every window it
        falls in has ended; otherwise it updates its windows that are still open.

    Examples
    --------
    >>> import numpy as np
    >>> from spark_stretch.ops import wordcount
    >>> from spark_stretch.engine.batch import ListColumn
    >>> eng = Engine(wordcount(WS=10), m=2, n=2)
    >>> eng.esg_in.add_sources([0], ordered=False)
    True
    >>> words = ListColumn([0, 2, 3], np.array(["a", "b", "a"], object))
    >>> eng.esg_in.add({"ts": np.array([1, 2]), "words": words}, 0)
    >>> eng.esg_in.advance_watermark(10); eng.drain()
    >>> out, wm = eng.esg_out.get_batch("driver")
    >>> eng.interner.lookup(out["key"]), out["count"].tolist(), wm
    (['a', 'b'], [2, 1], 10)
    """

    mode = "vsn"

    def __init__(self, op, m, n, n_buckets=1024, esg_in=None, threads=True, cap=8, out_reader="driver",
                 inline_rows=INLINE_ROWS, lateness="tuple", spill=None):
        _check_mn(m, n)
        if getattr(op, "engine_kind", "vsn") == "join" and self.mode != "vsn-join":
            raise EngineError(f"operator {op.name} is a JoinOperator; run it with JoinEngine (or setup(), "
                              "which picks the engine class)")
        if n_buckets < n:
            raise EngineError(f"n_buckets={n_buckets} < n={n}; use many more buckets than instances")
        self.op = op
        self.m, self.n, self.n_buckets = m, n, n_buckets
        if esg_in is None:
            self.interner = Interner()
            esg_in = ESG("in", n_streams=op.I, interner=self.interner)
        else:
            self.interner = esg_in.interner if esg_in.interner is not None else Interner()
            if esg_in.n_streams != op.I:
                raise EngineError(f"esg_in has {esg_in.n_streams} streams but operator {op.name} has I={op.I}")
        self.esg_in = esg_in
        if lateness not in ("tuple", "window"):
            raise EngineError(f"lateness={lateness!r}; use 'tuple' (ts <= watermark is late) or 'window' "
                              "(late when every window of the tuple has ended: Spark's rule)")
        if lateness == "window" and op.WA is not None:
            esg_in.late_window = (op.WA, op.WS)
        elif lateness == "window" and getattr(op, "session_end", None):
            esg_in.late_window = op.session_end
        self.lateness = lateness
        if esg_in.engine is None:
            esg_in.engine = self
            esg_in.validate = self._validate_batch
        self._backlog = []
        self.esg_out = ESG("out", n_streams=1, tie_columns=OUT_TIES, interner=self.interner)
        self.esg_out.engine = self
        S = tuple(getattr(op, "S", ()))
        self.esg_out.set_schema(0, ("ts", "key", "window_start", "window_end", *[c for c, _ in S], "_seq", "_sub"),
                                {c: (np.float64 if k == "f" else np.int64) for c, k in S})
        self.instances = [Instance(j, op) for j in range(n)]
        self.active = list(range(m))
        self.epoch = 0
        self.owner_map = balanced_owner_map(n_buckets, self.active)
        self.spill = spill  # (the state's memory budget: engine.spill; None: no budget)
        self._cap0 = cap  # (tables never shrink below it: shrink_sparse_tables)
        self._make_state(cap)
        self._rw = RWLock()
        self._drain_lock = threading.RLock()
        self._threads_on = threads
        self.inline_rows = inline_rows
        self._executor = None
        self._workers = []
        self._running = False
        self._busy = 0
        self._idle = threading.Condition()
        self._kernel, self._route = op.kernels()
        self._ip, self._fp = op.params()
        self.strings_ranked = 0  # (order_strings)
        self._m = {"tuples": 0, "segments": 0, "epoch_switches": 0, "last_switch_ms": 0.0, "grows": 0,
                   "shrinks": 0, "buckets_given_back": 0, "out_rows": 0, "state_bytes_copied": 0,
                   "pool_refills": 0}
        self.meter = Meter(n, n_buckets)  # busy time per instance, keys per bucket
        self.esg_in.add_readers(self.active)
        self.esg_out.add_sources(self.active, ordered=False)
        if out_reader is not None:
            self.esg_out.add_readers([out_reader])

    # ---- state (overridden by the shared-nothing engine) ----------------------------------------
    def _make_state(self, cap):
        op = self.op
        self.state = BucketState(self.n_buckets, op.n_int, op.n_float, op.init_i, op.init_f, cap,
                                 self._pool_spec(), spill=self.spill)

    def _pool_spec(self):
        """The register pool of the operator's HLL++ aggregates (``Operator.pool``: (aggregate
        q, first word, words) each), as ``BucketState`` takes it, or None."""
        pool = getattr(self.op, "pool", ())
        if not pool:
            return None
        base = 4 if self.op.session_end else 2  # (a session's record: start and end first)
        return [base + q for q, _, _ in pool], sum(w for _, _, w in pool), self.n

    def _pool_column(self):
        """The output int column with the pool row of an emitted window (None: no pool)."""
        pool = getattr(self.op, "pool", ())
        return [c for c, k in self.op.S if k == "i"].index(f"_{pool[0][0]}") if pool else None

    def _state_for(self, j):
        return self.state

    def _segment_for(self, j, seg, cols):
        return seg.ts, seg.stream, seg.row, seg.seq, cols

    # ---- processing -----------------------------------------------------------------------------
    def _validate_batch(self, stream, batch):
        """Reject a batch the operator cannot read at add() time (the engine stays usable). An
        operator that checks only the columns (names, types) is checked on none of the rows:
        building a large batch's kernel columns here too would cost a tenth of its step."""
        if stream < self.op.I:
            if not getattr(self.op, "checks_values", True):
                batch = {k: _slice(v, 0, 0) for k, v in batch.items()}
            self._cols_of(stream, batch)

    def _cols_of(self, stream, batch):
        return self.op.stream_cols(stream, batch)

    def _cols(self, seg):
        op = self.op
        c0 = op.stream_cols(0, seg.parts[0])
        c1 = op.stream_cols(1, seg.parts[1]) if op.I == 2 else c0
        op.check_user_functions((c0, c1))
        return c0, c1

    def _run_instance(self, j, seg, cols, owner_map):
        """Run instance j's kernel over a segment until done (growing buffers / state as asked)."""
        inst = self.instances[j]
        op = self.op
        ts, stream, row, seq, (c0, c1) = self._segment_for(j, seg, cols)
        ts, c0, c1 = frozen(ts), frozen(c0), frozen(c1)
        inst.opos[0] = 0
        inst.resume[:] = 0
        inst.gathered, inst.gathered_to = [], 0
        inst.fired_to = 0  # (buckets before it fired, and the empty ones given back)
        parts = []
        WA = op.WA or 1
        WS = op.WS or 1
        while True:
            st = self._state_for(j)
            inst.resume[4:6] = self._trim_every(st)  # (a grow may have put the tables in files)
            self._rw.acquire_read()
            ver = st.version
            try:
                status = self._kernel(j, owner_map, WA, WS, op.wkind, seg.prev_watermark, seg.watermark,
                                      ts, stream, row, seq, c0, c1, self._ip, self._fp,
                                      st.rec, st.acc_f, st.bcount, st.bminl, st.dirty,
                                      st.init_i, st.init_f, st.pool, st.free,
                                      inst.o_ts, inst.o_key, inst.o_l, inst.o_seq, inst.o_sub, inst.o_i,
                                      inst.o_f, inst.opos, inst.resume, inst.keybuf,
                                      op.max_out_update, op.max_out_fire)
            finally:
                self._rw.release_read()
            if status == K.DONE:
                break
            if status == K.NEED_OUT:
                if not self.esg_out.in_order and inst.o_ts.shape[0] >= OUT_CHUNK_ROWS:
                    parts.append(self._block(inst))  # (then the kernel goes on from row 0)
                    inst.opos[0] = 0
                    if inst.resume[0] == 1:  # (firing at the watermark: buckets resume[1:] left)
                        self._give_back_fired(j, inst, owner_map)
                else:
                    inst.grow_out()
            elif status == K.NEED_GROW:
                self._grow_state(st, ver)
            elif status == K.NEED_POOL:
                self._refill_pool(j, st)
            elif status == K.NEED_TRIM:
                st.trim()
            elif status == K.NEED_KEYBUF:
                inst.keybuf = np.empty(max(int(inst.resume[2]), 2 * inst.keybuf.shape[0]), np.int64)
                inst.resume[2] = inst.resume[3] = 0
            else:  # pragma: no cover
                raise EngineError(f"kernel returned unknown status {status}")
        return parts + [self._block(inst)] if parts else self._block(inst)

    def _give_back_fired(self, j, inst, owner_map):
        """A close firing millions of windows into output blocks: the pages of instance
        ``j``'s buckets it has fired and emptied since the last block go back to the system
        (``BucketState.give_back_empty``), so the tables and the blocks are never both whole.
        Tables of ``SHRINK_BYTES`` or more only; :meth:`_settle_given_back` ends it with the
        segment. (Not in free-running mode, which has no segment end to settle at.)"""
        hi = int(inst.resume[1])
        self._rw.acquire_read()
        try:
            st = self._state_for(j)
            if not self._running and isinstance(st, BucketState) and st.nbytes() >= SHRINK_BYTES:
                mine = np.asarray(owner_map[inst.fired_to:hi]) == j
                self._m["buckets_given_back"] += st.give_back_empty(inst.fired_to, hi, mine)
        finally:
            self._rw.release_read()
        inst.fired_to = hi

    def _settle_given_back(self):
        """At a segment's end, the tables whose buckets a close gave back: shrunk if the close
        left them nearly empty, else those buckets made empty slots again
        (``BucketState.settle_given_back``). Nothing reads a given-back page before."""
        for st in self._bucket_states():
            if not st.given_back.any():
                continue
            self._rw.acquire_write()
            try:
                if st.settle_given_back(self._cap0):
                    self._m["shrinks"] += 1
            finally:
                self._rw.release_write()

    def _grow_state(self, st, ver, cap=None):
        """Grow the shared state (to ``cap`` slots a bucket; default the next size) under the
        write lock, unless another instance already did (its ``version`` moved on since ``ver``
        was read)."""
        self._rw.acquire_write()
        try:
            if st.version == ver:
                st.grow() if cap is None else st.grow(cap)  # (a join's store: no size)
                self._m["grows"] += 1
        finally:
            self._rw.release_write()

    def _refill_pool(self, j, st):
        """Give instance ``j`` free rows of the register pool under the write lock (unless
        another instance's refill already did): its output rows' words gathered so far, the
        rows no window and no other instance's output row holds are collected, and the pool
        grown if few are."""
        self._rw.acquire_write()
        try:
            col = self._pool_column()
            inst = self.instances[j]
            p = int(inst.opos[0])
            if p > inst.gathered_to:
                inst.gathered.append(st.pool[inst.o_i[inst.gathered_to:p, col]])
                inst.gathered_to = p
            if st.free[j, 0] == 0:
                users = self._pool_users(j)
                st.refill(users, [self.instances[i].o_i[self.instances[i].gathered_to:
                                                        int(self.instances[i].opos[0]), col]
                                  for i in users if i != j])
                self._m["pool_refills"] += 1
        finally:
            self._rw.release_write()

    def _pool_users(self, j):
        """The instances that take rows of instance ``j``'s state's pool (all active: shared)."""
        return list(self.active)

    def _block(self, inst):
        """The instance's output rows, sorted (unless ESG_out takes them as they come: whole
        batches), as new arrays (gathered once from its buffers)."""
        p = int(inst.opos[0])
        op = self.op
        if self._rows_as_they_come:
            return self._unordered_block(inst, p)
        perm = sort_rows({"ts": inst.o_ts[:p], "key": inst.o_key[:p], "window_start": inst.o_l[:p],
                          "_seq": inst.o_seq[:p], "_sub": inst.o_sub[:p]}, OUT_TIES) \
            if self.esg_out.in_order else np.arange(p)
        l = inst.o_l[:p][perm]
        out = {"ts": inst.o_ts[:p][perm], "key": inst.o_key[:p][perm], "window_start": l,
               "window_end": np.where(l >= 0, l + (op.WS or 0), -1) if op.WA is not None else l.copy()}
        ii = ff = 0
        for name, kind in op.S:
            if kind == "i":
                out[name] = inst.o_i[:p, ii][perm]
                ii += 1
            else:
                out[name] = inst.o_f[:p, ff][perm]
                ff += 1
        if getattr(op, "pool", ()):  # an HLL++'s output: its words, from the window's pool row
            rows = inst.o_i[:p, self._pool_column()][perm]
            words = self._state_for(inst.id).pool[rows]  # (one copy: they are big)
            if inst.gathered:  # (output rows gathered before a refill: from there instead)
                early = perm < inst.gathered_to
                words[early] = np.concatenate(inst.gathered)[perm[early]]
            for q, at, w in op.pool:
                out[f"_{q}"] = words[:, at:at + w]
        out["_seq"] = inst.o_seq[:p][perm]
        out["_sub"] = inst.o_sub[:p][perm]
        return out

    @property
    def _rows_as_they_come(self) -> bool:
        """Whether output blocks are :meth:`_unordered_block`'s: whole batches' rows in no
        order, unless an HLL++'s words come with them (from the register pool)."""
        return not self.esg_out.in_order and not getattr(self.op, "pool", ())

    def _unordered_block(self, inst, p):
        """Whole batches' output rows as they came: copies of the buffers' first ``p`` rows,
        only the columns ESG_out keeps for them (:meth:`apply_whole_batches`): no window end
        (the start and the operator's size give it), no tie columns, nothing to sort."""
        out = {"ts": inst.o_ts[:p].copy(), "key": inst.o_key[:p].copy(),
               "window_start": inst.o_l[:p].copy()}
        ii = ff = 0
        for name, kind in self.op.S:
            out[name] = (inst.o_i[:p, ii] if kind == "i" else inst.o_f[:p, ff]).copy()
            ii, ff = ii + (kind == "i"), ff + (kind != "i")
        return out

    def _process_segment(self, seg):
        cols = self._cols(seg)
        om = self.owner_map
        act = list(self.active)
        self.meter.segment(self.op, seg, cols, self._ip)
        timed, run = self.meter.timed, self._run_instance
        try:
            if len(act) == 1 or not self._threads_on or len(seg) < self.inline_rows:
                blocks = [timed(j, run, j, seg, cols, om) for j in act]
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.n, thread_name_prefix="stretch-instance")
                futs = [self._executor.submit(timed, j, run, j, seg, cols, om) for j in act]
                wait(futs)  # (all of them, even if one failed: then settle)
                blocks = [f.result() for f in futs]
        finally:
            self._settle_given_back()
        for j, blk in zip(act, blocks):
            self._emit(j, blk, seg.watermark)
        self._grow_if_loaded()
        self._m["tuples"] += len(seg)
        self._m["segments"] += 1

    def _grow_if_loaded(self):
        """Grow a state whose buckets that hold windows are past 13/16 full on average
        (:func:`~.buckets.loaded`), at once to the size that leaves them under it. A kernel
        grows the tables only when one bucket would pass 15/16: among thousands of buckets the
        fullest passes 13/16 long before the average does, and growing then left the tables
        about half empty (BENCHMARKS.md, aggregation state at scale). Between
        segments: no kernel runs."""
        for st in self._bucket_states():
            used = st.bcount[st.bcount > 0]  # (a join's store grows by itself)
            windows = int(used.sum())
            if used.size and loaded(windows, used.size, st.cap):
                self._grow_state(st, st.version, cap_for(windows, used.size, st.cap))

    def _trim_every(self, st) -> tuple:
        """Tuples, and buckets spanned emitting, between two drops of the pages a kernel touched,
        for tables past the memory budget (0, 0: no drops; the tables are in memory). The
        instances run at once, each within its share of the budget; a tuple maps up to 16 pages
        of each table (on a read fault the kernel maps the cached pages around), an emission
        the rows of the buckets it spans."""
        if self.spill is None or not st.spilled():
            return 0, 0
        row = st.rec[0].nbytes + st.acc_f[0].nbytes
        share = self.spill.budget // self.n
        return max(1, share // (32 * mmap.PAGESIZE)), max(1, share // row)

    def _emit(self, j, blk, watermark):
        for part in blk if isinstance(blk, list) else [blk]:  # (a list: whole batches' chunks)
            if len(part["ts"]):
                self.esg_out.add(part, j, presorted=True)
                self._m["out_rows"] += len(part["ts"])
        self.esg_out.add_watermark(watermark, j)

    def drain(self, timeout=None):
        """Process everything ESG_in has released (blocking). In free-running mode: wait until idle."""
        if self._running:
            return self._wait_idle(timeout)
        with self._drain_lock:
            while True:
                act = list(self.active)
                if self._backlog:
                    items, self._backlog = self._backlog, []
                else:
                    items = self.esg_in.get(act[0])
                    for j in act[1:]:
                        self.esg_in.get(j)
                if not items:
                    return
                for i, it in enumerate(items):
                    try:
                        if isinstance(it, Control):
                            self._apply_control(it, lead=act[0])
                        else:
                            self._process_segment(it)
                    except Exception as e:
                        self._backlog = list(items[i:])  # nothing is lost: retried by the next drain()
                        if isinstance(e, EngineError):
                            raise
                        raise EngineError(f"operator {getattr(self.op, 'name', '?')} failed on a segment of "
                                          f"{len(it)} tuples: {type(e).__name__}: {e}") from e

    # ---- free-running mode ----------------------------------------------------------------------
    def start(self):
        """Free-running mode: one thread per instance (n threads; pooled ones idle) as in the paper."""
        if self._running:
            return
        self._running = True
        self._workers = [threading.Thread(target=self._worker, args=(j,), daemon=True, name=f"stretch-o{j}")
                         for j in range(self.n)]
        for t in self._workers:
            t.start()

    def stop(self):
        """Stop the worker threads (after :meth:`drain` if you need everything processed)."""
        self._running = False
        with self.esg_in._lock:
            self.esg_in._lock.notify_all()
        with self._idle:
            self._idle.notify_all()
        for t in self._workers:
            t.join()
        self._workers = []

    def _worker(self, j):
        backoff = 1e-4
        while self._running:
            if j not in self.esg_in._readers:
                with self._idle:
                    self._idle.wait(backoff)
                    backoff = min(backoff * 2, 0.01)
                continue
            backoff = 1e-4
            items = self.esg_in.get(j, block=True, timeout=0.01)
            if not items:
                continue
            with self._idle:
                self._busy += 1
            try:
                for it in items:
                    if isinstance(it, Control):
                        it.barrier.wait()
                    else:
                        blk = self.meter.timed(j, self._run_instance, j, it, self._cols(it),
                                               self.owner_map)
                        self._emit(j, blk, it.watermark)
                        if j == self.active[0]:
                            self.meter.segment(self.op, it, self._cols(it), self._ip)
                            self._m["tuples"] += len(it)
                            self._m["segments"] += 1
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _wait_idle(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while True:
                pending = any(self.esg_in.pending_for(j) for j in list(self.active))
                if not pending and self._busy == 0:
                    return
                rem = None if deadline is None else deadline - time.monotonic()
                if rem is not None and rem <= 0:
                    raise EngineError(f"drain timed out after {timeout}s")
                self._idle.wait(0.001 if rem is None else min(rem, 0.001))

    def close(self):
        if self._running:
            self.stop()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    # ---- metrics and outputs, state read when idle ----------------------------------------------
    def metrics(self) -> dict:
        """Counters: late_dropped, tuples, segments, epoch, epoch_switches, last_switch_ms, grows, ..."""
        d = dict(self._m)
        d.update(late_dropped=self.esg_in.late_dropped, epoch=self.epoch, active=list(self.active),
                 live_windows=self.live_windows(), watermark=self.esg_in.watermark,
                 dirty_buckets=int(self._dirty().sum()))
        return d

    def live_windows(self):
        return self.state.live_windows()

    def apply_whole_batches(self, ordered_output: bool = False) -> bool:
        """Apply each batch's tuples as they came, at once, and fire windows at the watermark
        only (``kernels.WHOLE``), when the result cannot depend on the order: a built-in
        aggregation over time windows of counts, sums, means, and minima and maxima of
        integers, in append mode (windows fired only by the watermark). (A sum of doubles
        rounds by its order, as Spark's own does by the order its partitions merge in; exact
        for integral values below 2**53.) The ESG then neither sorts nor holds back
        tuples; the caller hands over every batch with :meth:`release_all`. Unless
        ``ordered_output`` (rows that must line up with another engine's), ESG_out takes the
        output rows as they come too: in no particular order, a window close of millions of
        windows in blocks of :data:`OUT_CHUNK_ROWS` (``get_batch(chunks=True)``). Returns
        whether it applies (otherwise nothing changes: tuples in event-time order).

        Examples
        --------
        >>> import numpy as np
        >>> from spark_stretch.ops import aggregate_many
        >>> eng = Engine(aggregate_many([("count", None, "i", None), ("max", "v", "i", None)],
        ...                             key="k", WS=10, WA=10),
        ...              m=1, n=1, threads=False)
        >>> eng.esg_in.add_sources([0], ordered=False, watermark=0)
        True
        >>> eng.apply_whole_batches()
        True
        >>> eng.esg_in.add({"ts": np.array([15, 3]), "k": np.array([1, 1]), "v": np.array([4, 9])}, 0)
        >>> eng.release_all(0); eng.esg_in.advance_watermark(10); eng.drain()
        >>> out = eng.esg_out.get_batch("driver")[0]
        >>> out["window_start"].tolist(), out["_0"].tolist(), out["_1"].tolist()
        ([0], [1], [9])
        """
        ip = self._ip
        if (getattr(self.op, "engine_kind", "vsn") != "vsn" or self.op.builtin_ip is None
                or ip[3] != K.IN_ORDER or self.op.WA is None
                or getattr(self.op, "session_end", None)):  # (a join's parameters are its own)
            return False
        if not all(c in _ORDER_FREE for c in (_fused_codes(ip) or [int(ip[2])])):
            return False
        self._ip = ip.copy()  # (the operator's own stays as it was)
        self._ip[3] = K.WHOLE
        self.esg_in.in_order = False
        self.esg_out.in_order = ordered_output
        if self._rows_as_they_come:
            self.esg_out.set_schema(0, ("ts", "key", "window_start",
                                        *[c for c, _ in getattr(self.op, "S", ())]))
            self.esg_out.give_rows_only()
        return True

    @property
    def applies_whole_batches(self) -> bool:
        """Whether :meth:`apply_whole_batches` applies."""
        return getattr(self.op, "engine_kind", "vsn") == "vsn" and int(self._ip[3]) == K.WHOLE

    def shrink_sparse_tables(self, min_bytes: int = SHRINK_BYTES) -> int:
        """Give back the memory of tables the windows left fill little of: a state whose
        tables hold ``min_bytes`` or more and whose fullest bucket is at most an eighth full is
        rehashed into tables of twice what is left (``BucketState.shrink``, never below the
        engine's first ``cap``). For a close of millions of windows whose rows are made next
        (the aggregation runtime's append-mode close): the tables go before the rows come,
        not both at once. Not after every drain: windows a drain opens and closes again would
        grow the tables back each time. Call when idle. Returns how many states shrank.

        Examples
        --------
        >>> import numpy as np
        >>> from spark_stretch.ops import wordcount
        >>> from spark_stretch.engine.batch import ListColumn
        >>> eng = Engine(wordcount(WS=10), m=1, n=1, n_buckets=4, cap=8)
        >>> eng.esg_in.add_sources([0], ordered=False)
        True
        >>> words = ListColumn(np.arange(2001), np.arange(2000).astype(str).astype(object))
        >>> eng.esg_in.add({"ts": np.arange(2000) % 5, "words": words}, 0)
        >>> eng.esg_in.advance_watermark(10); eng.drain()
        >>> eng.state.cap > 500, eng.state.live_windows()
        (True, 0)
        >>> eng.shrink_sparse_tables(min_bytes=0), eng.state.cap
        (1, 8)
        >>> eng.close()
        """
        shrunk = 0
        for st in self._bucket_states():
            if st.nbytes() < min_bytes:
                continue
            self._rw.acquire_write()
            try:
                if st.shrink(self._cap0):
                    shrunk += 1
                    self._m["shrinks"] += 1
            finally:
                self._rw.release_write()
        return shrunk

    def release_all(self, stamp: int) -> None:
        """Apply every tuple added so far now, closing no window the watermark does not close,
        and stamp each window it updates with ``stamp`` (> 0; a ``stamped`` built-in
        aggregation): Spark's update and complete output modes, which see a whole batch
        applied. :meth:`state_rows` then reads the windows."""
        if self.op.builtin_ip is None or self._ip[3] == K.IN_ORDER:
            raise EngineError(f"operator {self.op.name} applies tuples in order, not whole "
                              "batches (a stamped built-in aggregation, or apply_whole_batches)")
        self._ip[7] = stamp
        self.esg_in.release_all()
        self.drain()

    def order_strings(self, rank: np.ndarray) -> None:
        """Give the aggregates that compare strings (``ops.aggregate_many``'s ``min_s``/
        ``max_s``, ``max_by_s``/``min_by_s``) the order of the interned strings: ``rank[id]``,
        string ``id``'s place among all interned strings (in Spark's order: by their UTF-8
        bytes). Ranks change as strings are added, so each such aggregate's state, the rank
        of its extremum, is re-ranked here. Call when idle, with every string of the tuples
        still to apply ranked."""
        ip = self._ip
        codes = _fused_codes(ip)
        # (the slot of the extremum's id: a min_s's own, a max_by_s's by_key after it)
        qs = [(q, q + (c != K.AGG_MIN_S and c != K.AGG_MAX_S)) for q, c in enumerate(codes)
              if c in (K.AGG_MIN_S, K.AGG_MAX_S, K.AGG_MAXBY_S, K.AGG_MINBY_S)]
        self._fp = np.concatenate([self.op.params()[1][:1], np.asarray(rank, np.float64)])
        self.strings_ranked = len(rank)
        base = 4 if self.op.session_end else 2  # (a session's record: start and end first)
        for st in self._states():
            live = st.live_mask()
            for q, at in qs:
                f = self._float_slot(q)
                had = st.acc_f[:, :, f][live]
                ids = st.rec[:, :, base + at][live]
                st.acc_f[:, :, f][live] = np.where(np.isfinite(had), self._fp[1 + ids], had)

    def _float_slot(self, q: int) -> int:
        """Fused aggregate q's float slot (``Operator.float_cols``)."""
        cols = getattr(self.op, "float_cols", None)
        return q if cols is None else cols.index(q)

    def state_rows(self, stamp=None, words=False):
        """The live windows (of the updates stamped ``stamp`` only, if given) as ``(rec,
        acc_f)``: one row per window, ``rec[:, 0]`` the key, ``rec[:, 1]`` the window start,
        then the int accumulators; ``acc_f`` the float ones (a fused aggregation's: one column
        per aggregate, 0.0 for one that keeps no float). With ``words``, also each HLL++
        aggregate's words, ``{q: words}`` (a row per window; its int slot holds a pool row).
        Call when idle."""
        recs, accs, held = [], [], []
        for st in self._states():
            live = st.live_mask()
            if stamp is not None:  # (the stamp is the last int slot)
                live &= st.rec[:, :, 1 + st.init_i.shape[0]] == stamp
            recs.append(st.rec[live])
            accs.append(self._all_floats(st.acc_f[live]))
            held.append(st.pool[st.held_rows(live)])
        rows = np.concatenate(recs), np.concatenate(accs)
        if not words:
            return rows
        pool = np.concatenate(held)
        return (*rows, {q: pool[:, at:at + w] for q, at, w in getattr(self.op, "pool", ())})

    def _all_floats(self, acc: np.ndarray) -> np.ndarray:
        """Windows' float slots as one column per fused aggregate (0.0 for one keeping none)."""
        cols = getattr(self.op, "float_cols", None)
        if cols is None:
            return acc
        out = np.zeros((len(acc), int(self._ip[8])), np.float64)
        out[:, list(cols)] = acc
        return out

    def stamped_rows(self, stamp: int) -> int:
        """How many live windows carry the update stamp ``stamp`` (a stamped aggregation's
        windows the batch changed). Call when idle."""
        n = 0
        for st in self._states():
            n += int(np.count_nonzero(st.rec[:, :, 1 + st.init_i.shape[0]] == stamp))
        return n

    def _states(self):
        return [self.state]

    def _bucket_states(self):
        """The states that are bucket tables (a join's store is not: it grows by itself)."""
        return [st for st in self._states() if isinstance(st, BucketState)]

    def _dirty(self):
        return self.state.dirty

    def read_output(self, reader="driver", format="dict", decode=True):
        """Released results for ``reader`` (ts-ordered) and the output watermark; string keys decoded."""
        batch, wm = self.esg_out.get_batch(reader)
        if decode and len(batch["ts"]):
            batch = dict(batch)
            batch.update(self.op.decode_keys(batch["key"], self.interner))
        if format == "arrow":
            return to_arrow(batch), wm
        return batch, wm


def sorted_block(out):
    """An instance's output block in ``(ts, key, window_start, _seq, _sub)`` order (sorted on its own thread)."""
    if len(out["ts"]) > 1:
        perm = sort_rows(out, OUT_TIES)
        out = {k: v[perm] for k, v in out.items()}
    return out
