"""Tuple-store state for J+ operators with I = 2 (ScaleJoin, Operator 10 of stretch-tpds Appendix D).

``f_MK`` returns the K "shares" ``{0, .., K-1}`` for every tuple; share ``k`` (in bucket
``bucket_of(k)``, so owned by one instance per epoch) compares the tuple with the tuples of the other
stream it stores, and stores the tuple when ``rank % K == k`` (round robin, ``rank`` = the tuple's
position in ESG_in's total order). Window: single type with WA = delta = 1 time unit; a stored tuple
``t'`` matches ``t`` while ``t.ts - t'.ts < WS`` (older ones are purged, f_S).

Per bucket the store is an append-only list (timestamp order) ``e_ts/e_key/e_str/e_pay[b, head:tail]``;
purging advances ``head``. Results carry ``ts = t.ts`` (the later tuple), ``key = k``, and the
payloads of the left (stream 0) and right (stream 1) tuple.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import numpy as np
from .jit import njit

from . import kernels as K
from .errors import EngineError
from .runtime import Engine, sorted_block

PRED_ALL, PRED_BAND, PRED_HEDGE = 0, 1, 2


@njit(nogil=True, cache=True)
def _pred_builtin(lp, rp, ip, fp):
    code = ip[0]
    if code == PRED_BAND:
        return abs(lp[0] - rp[0]) <= fp[0] and abs(lp[1] - rp[1]) <= fp[1]
    if code == PRED_HEDGE:
        if lp[0] == rp[0] or lp[2] == 0.0 or rp[2] == 0.0:
            return False
        nd_l = (lp[1] - lp[2]) / lp[2]
        nd_r = (rp[1] - rp[2]) / rp[2]
        if nd_l == 0.0:
            return False
        return fp[0] <= nd_r / nd_l
    return True


_PRED = _pred_builtin


def _join_kernel_py(j, owner, WS, n_shares, ts, stream, row, seq, pay0, pay1, ip, fp,
                    e_ts, e_key, e_str, e_pay, head, tail, dirty,
                    o_ts, o_key, o_seq, o_sub, o_pay, opos, resume):
    nb = e_ts.shape[0]
    cap = e_ts.shape[1]
    F = e_pay.shape[2]
    cap_out = o_ts.shape[0]
    i0 = resume[1]
    for i in range(i0, ts.shape[0]):
        t = ts[i]
        s = stream[i]
        pay = pay0[row[i]] if s == 0 else pay1[row[i]]
        for k in range(resume[2] if i == i0 else 0, n_shares):
            b = K.bucket_of(k, nb)
            if owner[b] != j:
                continue
            h = head[b]
            while h < tail[b] and e_ts[b, h] <= t - WS:
                h += 1
            head[b] = h
            store = seq[i] % n_shares == k
            if store and tail[b] == cap:
                if h > 0:  # compact
                    n = tail[b] - h
                    for q in range(n):
                        e_ts[b, q] = e_ts[b, h + q]
                        e_key[b, q] = e_key[b, h + q]
                        e_str[b, q] = e_str[b, h + q]
                        e_pay[b, q, :] = e_pay[b, h + q, :]
                    head[b] = 0
                    tail[b] = n
                    h = 0
                else:
                    resume[1] = i
                    resume[2] = k
                    return K.NEED_GROW
            if opos[0] + (tail[b] - h) > cap_out:
                resume[1] = i
                resume[2] = k
                return K.NEED_OUT
            sub = 0
            p = opos[0]
            for e in range(h, tail[b]):
                if e_key[b, e] != k or e_str[b, e] == s:
                    continue
                if s == 0:
                    ok = _PRED(pay, e_pay[b, e], ip, fp)
                else:
                    ok = _PRED(e_pay[b, e], pay, ip, fp)
                if ok:
                    o_ts[p] = t
                    o_key[p] = k
                    o_seq[p] = seq[i]
                    o_sub[p] = sub
                    if s == 0:
                        o_pay[p, :F] = pay
                        o_pay[p, F:] = e_pay[b, e]
                    else:
                        o_pay[p, :F] = e_pay[b, e]
                        o_pay[p, F:] = pay
                    p += 1
                    sub += 1
            opos[0] = p
            if store:
                q = tail[b]
                e_ts[b, q] = t
                e_key[b, q] = k
                e_str[b, q] = s
                e_pay[b, q, :] = pay
                tail[b] = q + 1
                dirty[b] = 1
    resume[1] = ts.shape[0]
    return K.DONE


join_kernel = njit(nogil=True, cache=True)(_join_kernel_py)


def specialize_join(pred):
    """Join kernel bound to a user numba predicate ``pred(left_payload, right_payload, ip, fp) -> bool``."""
    g = dict(globals())
    g["_PRED"] = pred
    return njit(nogil=True)(types.FunctionType(_join_kernel_py.__code__, g, "_join_kernel"))


@dataclass
class JoinOperator:
    """J+ (WA = 1, WS, I = 2, f_MK = {0..K-1}, single, S, f_mu, f_U = match + store, -, f_S = purge).

    ``left`` / ``right``: the numeric payload columns of stream 0 / 1 (same count F; ids as numbers).
    Output columns: ``l_<left>`` then ``r_<right>`` (float64).
    """

    WS: int
    left: tuple
    right: tuple
    shares: int = 16
    pred: object = PRED_ALL  # built-in code, or a numba function (lp, rp, ip, fp) -> bool
    fp: tuple = ()
    name: str = "J+"
    I: int = 2
    WA: int = 1
    WT: str = "single"
    _kernel: object = field(default=None, repr=False, compare=False)
    engine_kind = "join"  # (not a field) run by JoinEngine: engine.factory

    def __post_init__(self):
        if len(self.left) != len(self.right):
            raise EngineError(f"left has {len(self.left)} payload columns and right {len(self.right)}; "
                              "the store needs the same number on both sides (pad with a constant column)")
        if int(self.WS) <= 0:
            raise EngineError(f"WS={self.WS}; the join window must be positive")
        if int(self.shares) < 1:
            raise EngineError(f"shares={self.shares}; K must be >= 1")

    @property
    def S(self):
        return tuple((f"l_{c}", "f") for c in self.left) + tuple((f"r_{c}", "f") for c in self.right)

    def kernel(self):
        if self._kernel is None:
            self._kernel = join_kernel if isinstance(self.pred, int) else specialize_join(self.pred)
        return self._kernel

    def params(self):
        ip = np.array([self.pred if isinstance(self.pred, int) else -1], np.int64)
        return ip, np.asarray(self.fp if self.fp else (0.0,), np.float64)

    def payload(self, stream, batch):
        names = self.left if stream == 0 else self.right
        if batch is None:
            return np.zeros((0, len(names)), np.float64)
        for c in names:
            if c not in batch:
                raise EngineError(f"stream {stream} has no column {c!r} (columns: {sorted(batch)})")
        return np.ascontiguousarray(np.stack([np.asarray(batch[c], np.float64) for c in names], axis=1))

    # the runtime asks these of any operator
    n_out_int = 1
    n_out_float = 1

    def kernels(self):
        return None, None

    def decode_keys(self, keys, interner):
        return {}


class JoinStore:
    """Per-bucket append-only tuple lists (see the module docstring)."""

    def __init__(self, n_buckets, F, cap=16):
        self.n_buckets = n_buckets
        self.e_ts = np.zeros((n_buckets, cap), np.int64)
        self.e_key = np.zeros((n_buckets, cap), np.int64)
        self.e_str = np.zeros((n_buckets, cap), np.int64)
        self.e_pay = np.zeros((n_buckets, cap, F), np.float64)
        self.head = np.zeros(n_buckets, np.int64)
        self.tail = np.zeros(n_buckets, np.int64)
        self.dirty = np.zeros(n_buckets, np.uint8)
        self.version = 0

    def grow(self):
        for name in ("e_ts", "e_key", "e_str", "e_pay"):
            a = getattr(self, name)
            shape = (a.shape[0], a.shape[1] * 2) + a.shape[2:]
            na = np.zeros(shape, a.dtype)
            na[:, :a.shape[1]] = a
            setattr(self, name, na)
        self.version += 1

    def live_windows(self):
        return int((self.tail - self.head).sum())

    def arrays(self):
        return {k: getattr(self, k) for k in ("e_ts", "e_key", "e_str", "e_pay", "head", "tail", "dirty")}

    @classmethod
    def from_arrays(cls, a):
        st = cls.__new__(cls)
        for k, v in a.items():
            setattr(st, k, np.array(v, copy=True))
        st.n_buckets = st.e_ts.shape[0]
        st.version = 0
        return st


class JoinEngine(Engine):
    """VSN engine running a :class:`JoinOperator` (same API as :class:`Engine`)."""

    mode = "vsn-join"

    def _make_state(self, cap):
        self.state = JoinStore(self.n_buckets, len(self.op.left), max(cap, 16))

    def _cols(self, seg):
        return self.op.payload(0, seg.parts[0]), self.op.payload(1, seg.parts[1])

    def _cols_of(self, stream, batch):
        return self.op.payload(stream, batch)

    def _run_instance(self, j, seg, cols, owner_map):
        inst = self.instances[j]
        op = self.op
        kern = op.kernel()
        if not hasattr(inst, "o_pay") or inst.o_pay.shape[0] != inst.o_ts.shape[0]:
            inst.o_pay = np.zeros((inst.o_ts.shape[0], 2 * len(op.left)), np.float64)
        inst.opos[0] = 0
        inst.resume[:] = 0
        while True:
            st = self.state
            self._rw.acquire_read()
            ver = st.version
            try:
                status = kern(j, owner_map, op.WS, op.shares, seg.ts, seg.stream, seg.row, seg.seq,
                              cols[0], cols[1], self._ip, self._fp, st.e_ts, st.e_key, st.e_str, st.e_pay,
                              st.head, st.tail, st.dirty, inst.o_ts, inst.o_key, inst.o_seq, inst.o_sub,
                              inst.o_pay, inst.opos, inst.resume)
            finally:
                self._rw.release_read()
            if status == K.DONE:
                break
            if status == K.NEED_OUT:
                p = int(inst.opos[0])
                old = inst.o_pay
                inst.grow_out()
                inst.o_pay = np.zeros((inst.o_ts.shape[0], old.shape[1]), np.float64)
                inst.o_pay[:p] = old[:p]
            else:
                self._grow_state(st, ver)
        p = int(inst.opos[0])
        out = {"ts": inst.o_ts[:p].copy(), "key": inst.o_key[:p].copy(),
               "window_start": np.full(p, -1, np.int64), "window_end": np.full(p, -1, np.int64)}
        for c, (name, _) in enumerate(op.S):
            out[name] = inst.o_pay[:p, c].copy()
        out["_seq"] = inst.o_seq[:p].copy()
        out["_sub"] = inst.o_sub[:p].copy()
        return sorted_block(out)

    def _state_arrays(self, delta=False, lazy=False):
        return {"shared": self.state.arrays()}  # always whole: join stores are not incremental

    def _load_state_arrays(self, arrs):
        self.state = JoinStore.from_arrays(arrs["shared"])

    def _check_layout(self, op):
        width = self.state.e_pay.shape[2]
        if width != len(op.left):
            raise EngineError(f"the snapshot's join store keeps {width} payload columns, operator "
                              f"{op.name}'s {len(op.left)} (another version or query): restart "
                              "it from a new checkpoint location")

    def _apply_state_delta(self, arrs):
        self._load_state_arrays(arrs)
