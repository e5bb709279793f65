"""The O+ operator model: ``O+(WA, WS, I, f_MK, WT, S, f_mu, f_U, f_O, f_S)`` (stretch-tpds §4.2, Table I).

An :class:`Operator` is a plain description; the runtime compiles it into the engine kernel.

- ``WA``, ``WS``: window advance and size (same time unit as the timestamps). Window starts are multiples
  of ``WA`` from 0 (Spark's ``window(ts, WS, WA)`` with no offset). ``WA = WS = None``: no windows, the
  state of a key lives for ever and ``f_O`` is never called (keyed state, e.g. the value barrier).
- ``I``: number of input streams (1 or 2), each with its own columns.
- ``f_MK``: per stream, the multi-key function: a tuple yields any number of int64 keys, possibly the
  same key twice (it is then updated twice). The tuple is stored once whatever its number of keys.
- ``WT``: ``"multi"`` (a tuple updates every window it falls in, an expired window is output and
  removed) or ``"single"`` (a tuple updates only the earliest window it falls in; an expired window is
  output, then ``f_S`` slides it by ``WA`` keeping its state, or drops it).
- ``S``: output value columns, ``(name, "i" | "f")`` (int64 or float64).
- ``f_mu``: key -> instance: ``owner_map[bucket_of(key)]`` with ``B = n_buckets`` buckets; the runtime
  owns the owner map and changes it at epoch switches.
- ``f_U``, ``f_O``, ``f_S``: update, output and slide functions on a window's state, a fixed-width record
  of ``n_int`` int64 and ``n_float`` float64 slots initialised to ``init_i`` / ``init_f``.
  Defaults (Table I): ``f_U`` returns no output, ``f_O`` returns no output, ``f_S`` purges (drops).

Output rows carry ``ts`` = window end ``l + WS`` for ``f_O`` results and the input tuple's ``ts`` for
``f_U`` results, and are ordered by ``(ts, key, window_start, _seq, _sub)``.

User functions are numba ``@njit`` functions with these signatures (``cols`` is the tuple of the stream's
input arrays in the order of ``columns``; a list column gives two arrays, offsets then values)::

    f_mk(cols, row, keys_out) -> int                       # writes up to len(keys_out) keys, returns the count
    f_update(acc_i, acc_f, cols, row, key, out_i, out_f) -> int   # may write output rows, returns their count
    f_output(acc_i, acc_f, key, l, out_i, out_f) -> int
    f_slide(acc_i, acc_f) -> bool                          # True: keep (slid) state; False: drop

With ``python=True`` the same functions may be plain Python and the kernel runs in the interpreter: for
prototyping only, it is slow (per-row Python).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from .jit import njit

from . import kernels as K
from .errors import EngineError
from .batch import ListColumn
from .sessions import session_kernel


@njit(nogil=True, cache=True)
def default_update(acc_i, acc_f, cols, row, key, out_i, out_f):
    """Table I default f_U: no output (state unchanged)."""
    return 0


@njit(nogil=True, cache=True)
def default_output(acc_i, acc_f, key, l, out_i, out_f):
    """Table I default f_O: no output."""
    return 0


@njit(nogil=True, cache=True)
def default_slide(acc_i, acc_f):
    """Table I default f_S: purge (drop the window)."""
    return False


@dataclass
class Operator:
    """An O+ operator; see the module docstring. Build built-in ones with :mod:`spark_stretch.ops`.

    Examples
    --------
    >>> from spark_stretch.ops import wordcount
    >>> op = wordcount(WS=60, WA=60)
    >>> (op.WA, op.WS, op.I, op.WT, op.S)
    (60, 60, 1, 'multi', (('count', 'i'),))
    """

    WA: int | None
    WS: int | None
    I: int = 1
    f_MK: tuple = ()
    WT: str = "multi"
    S: tuple = ()
    f_U: tuple = ()
    f_O: object = None
    f_S: object = None
    n_int: int = 1
    n_float: int = 1
    init_i: tuple = (0,)
    init_f: tuple = (0.0,)
    columns: tuple = ()  # per stream: tuple of (name, numpy dtype) the kernel reads
    name: str = "O+"
    max_out_update: int = 1
    max_out_fire: int = 1
    python: bool = False
    builtin_ip: np.ndarray | None = None  # parameters of the built-in functions (None: user functions)
    builtin_fp: np.ndarray | None = None
    prepare: object = None  # optional override: (stream, batch or None) -> cols tuple
    decode: object = None  # optional: (keys, interner) -> dict of decoded key columns
    session_end: str | None = None  # built-in over session windows: the column of each tuple's session end
    pool: tuple = ()  # built-in HLL++ aggregates: (aggregate q, first word, words) of their register pool rows
    float_cols: tuple | None = None  # a fused built-in's aggregates with a float slot, in slot order (None: all)
    checks_values: bool = True  # whether reading a batch checks its values, not its columns only
    _compiled: object = field(default=None, repr=False, compare=False)
    engine_kind = "vsn"  # (not a field) the engine class that runs it: engine.factory

    def __post_init__(self):
        if self.I not in (1, 2):
            raise EngineError(f"I={self.I}; an O+ operator has 1 or 2 input streams")
        if self.WT not in ("multi", "single"):
            raise EngineError(f"WT={self.WT!r}; the window type must be 'multi' or 'single'")
        if (self.WA is None) != (self.WS is None):
            raise EngineError(f"WA={self.WA}, WS={self.WS}; give both (windowed) or neither (keyed state)")
        if self.WA is not None:
            if int(self.WA) <= 0 or int(self.WS) <= 0:
                raise EngineError(f"WA={self.WA}, WS={self.WS}; window advance and size must be positive")
            self.WA, self.WS = int(self.WA), int(self.WS)
        if self.builtin_ip is None:
            if len(self.f_MK) != self.I:
                raise EngineError(f"f_MK has {len(self.f_MK)} functions; give one per input stream (I={self.I})")
            if len(self.columns) != self.I:
                raise EngineError(f"columns has {len(self.columns)} entries; give one per input stream (I={self.I})")
            if not self.f_U:
                self.f_U = (default_update,) * self.I
            if len(self.f_U) != self.I:
                raise EngineError(f"f_U has {len(self.f_U)} functions; give one per input stream (I={self.I})")
            self.f_O = self.f_O or default_output
            self.f_S = self.f_S or default_slide
        self.S = tuple((str(n), str(k)) for n, k in self.S)
        for n, k in self.S:
            if k not in ("i", "f"):
                raise EngineError(f"output column {n!r} has kind {k!r}; use 'i' (int64) or 'f' (float64)")

    # ---- properties the runtime uses ------------------------------------------------------------
    @property
    def wkind(self):
        if self.WA is None:
            return K.W_NONE
        return K.W_MULTI if self.WT == "multi" else K.W_SINGLE

    @property
    def n_out_int(self):
        return max(1, sum(1 for _, k in self.S if k == "i"))

    @property
    def n_out_float(self):
        return max(1, sum(1 for _, k in self.S if k == "f"))

    def params(self):
        ip = self.builtin_ip if self.builtin_ip is not None else np.zeros(8, np.int64)
        fp = self.builtin_fp if self.builtin_fp is not None else np.zeros(1, np.float64)
        return np.asarray(ip, np.int64), np.asarray(fp, np.float64)

    def kernels(self):
        """(agg_kernel, route_kernel) for this operator (compiled lazily, cached per operator)."""
        if self._compiled is None:
            if self.builtin_ip is not None and not self.python:
                self._compiled = (session_kernel if self.session_end else K.agg_kernel, K.route_kernel)
            else:
                self._compiled = _user_kernels(self)
        return self._compiled

    def stream_cols(self, stream, batch):
        """Kernel input tuple of one stream from a segment part (``None``: no rows of that stream)."""
        if self.prepare is not None:
            return self.prepare(stream, batch)
        out = []
        for name, dt in self.columns[stream]:
            if batch is None:
                if dt == "list":
                    out += [np.zeros(1, np.int64), np.empty(0, np.int64)]
                else:
                    out.append(np.empty(0, dt))
                continue
            if name not in batch:
                raise EngineError(f"input stream {stream} has no column {name!r} (columns: {sorted(batch)}); "
                                  f"operator {self.name} reads {[c for c, _ in self.columns[stream]]}")
            c = batch[name]
            if isinstance(c, ListColumn):
                out += [c.offsets, np.ascontiguousarray(c.values, np.int64)]
            else:
                out.append(np.ascontiguousarray(c, dt))
        return tuple(out)

    def check_user_functions(self, cols):
        """Compile the user f_MK / f_U for the actual input types once and check what they return."""
        if self.builtin_ip is not None or self.python or getattr(self, "_checked", False):
            return
        from .jit import require_numba

        require_numba()  # (a user's numba functions: the kernels they meet are numba's)
        from numba import typeof, types

        from .jit import as_numba
        i64 = typeof(np.empty(1, np.int64))
        ai, af = typeof(np.empty(1, np.int64)), typeof(np.empty(1, np.float64))
        oi, of = typeof(np.empty((1, 1), np.int64)), typeof(np.empty((1, 1), np.float64))
        for s in range(self.I):
            ct = typeof(cols[s])
            for what, f, sig in (("f_MK", as_numba(self.f_MK[s]), (ct, types.int64, i64)),
                                 ("f_U", as_numba(self.f_U[s]),
                                  (ai, af, ct, types.int64, types.int64, oi, of))):
                try:
                    f.compile(sig)
                except Exception as e:
                    raise EngineError(f"{what} of stream {s} of operator {self.name} does not compile for "
                                      f"the input columns {ct}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
                ret = f.overloads[sig].signature.return_type
                if not isinstance(ret, types.Integer):
                    raise EngineError(f"{what} of stream {s} of operator {self.name} returns {ret}; it must "
                                      "return the int number of keys / output rows it wrote")
        self._checked = True

    def decode_keys(self, keys, interner):
        """Key columns for output rows (``{"key": ids}`` unless the operator says otherwise)."""
        if self.decode is not None:
            return self.decode(keys, interner)
        return {}


def _user_kernels(op: Operator):
    """Bind user functions into the generic kernel (numba, uncached) or run it in Python (``python=True``)."""
    from .jit import as_numba

    # (an operator's defaults are the engine's kernels: numba's dispatchers, to be compiled in)
    mk0, mk1, up0, up1, fo, fs = map((lambda f: f) if op.python else as_numba,
                                     (op.f_MK[0], op.f_MK[-1], op.f_U[0], op.f_U[-1], op.f_O,
                                      op.f_S))

    def mk(stream, cols0, cols1, row, out, ip):
        if stream == 0:
            return mk0(cols0, row, out)
        return mk1(cols1, row, out)

    mo = op.max_out_update

    mf = op.max_out_fire
    ni = 2 + op.n_int

    def upd(stream, cols0, cols1, row, vi, vf, key, l, rec, acc_f, b, s, oi, of, p, ip, fp):
        if stream == 0:
            return up0(rec[b, s, 2:ni], acc_f[b, s], cols0, row, key, oi[p:p + mo], of[p:p + mo])
        return up1(rec[b, s, 2:ni], acc_f[b, s], cols1, row, key, oi[p:p + mo], of[p:p + mo])

    def out(key, l, rec, acc_f, b, s, oi, of, p, ip, fp):
        return fo(rec[b, s, 2:ni], acc_f[b, s], key, l, oi[p:p + mf], of[p:p + mf])

    def slide(rec, acc_f, b, s, ip, fp):
        return fs(rec[b, s, 2:ni], acc_f[b, s])

    def val(stream, cols0, cols1, row, ip):
        return 0, 0.0

    if op.python:
        import types
        g = dict(vars(K))
        g.update(_MK=mk, _UPD=upd, _OUT=out, _SLIDE=slide, _VAL=val, _BUILTIN=False)

        def clone(f):
            return types.FunctionType(f.__code__, g, f.__name__)

        g["_fire_bucket"] = clone(K._fire_bucket_py)
        return clone(K._agg_kernel_py), clone(K._route_py)
    from numba import njit as numba_njit  # (as_numba imported numba)

    j = numba_njit(nogil=True)
    return K.specialize(j(mk), j(upd), j(out), j(slide), j(val))
