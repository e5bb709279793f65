"""The papers' other example operators, written with user-defined numba f_MK / f_U / f_O.

- :func:`passthrough`: Operator 15 (Q2): I = 2 streams with their own schemas; ``f_MK`` returns the K
  shares and ``f_U`` forwards the tuple's payload (one output per share).
- :func:`value_barrier`: the value-barrier application of dgs-flumina (sum of the values between two
  consecutive barriers, order-dependent across keys) as two composed operators:
  ``partials`` (I = 2: values keyed by substream; a barrier has every substream as key, outputs each
  substream's running sum and resets it) feeding ``totals`` (sums the partials of each barrier).

Examples
--------
>>> op = passthrough(K=1)
>>> op.I, [c for c, _ in op.S]
(2, ['src', 'a', 'b', 'c'])
"""
from __future__ import annotations

from ..engine.operator import Operator


def njit(**opts):
    """numba's ``njit``, imported when an example operator is made (these are user numba
    functions: an engine that runs none does not import numba)."""
    from numba import njit as numba_njit

    return numba_njit(**opts)


def passthrough(K=1):
    """Operator 15: stream 0 ``(a: int)``, stream 1 ``(b: float, c: float)``; outputs every tuple K times."""

    @njit(nogil=True)
    def mk(cols, row, out):
        for k in range(min(K, out.shape[0])):
            out[k] = k
        return K

    @njit(nogil=True)
    def up0(ai, af, cols, row, key, oi, of):
        oi[0, 0] = 0
        oi[0, 1] = cols[0][row]
        of[0, 0] = 0.0
        of[0, 1] = 0.0
        return 1

    @njit(nogil=True)
    def up1(ai, af, cols, row, key, oi, of):
        oi[0, 0] = 1
        oi[0, 1] = 0
        of[0, 0] = cols[0][row]
        of[0, 1] = cols[1][row]
        return 1

    return Operator(WA=None, WS=None, I=2, f_MK=(mk, mk), f_U=(up0, up1), WT="multi",
                    S=(("src", "i"), ("a", "i"), ("b", "f"), ("c", "f")),
                    columns=((("a", "int64"),), (("b", "float64"), ("c", "float64"))),
                    n_int=1, n_float=1, name=f"passthrough(K={K})")


def value_barrier_partials(P):
    """First operator: stream 0 values ``(sub: int in [0, P), v: int)``, stream 1 barriers ``(b: int)``."""

    @njit(nogil=True)
    def mk_value(cols, row, out):
        out[0] = cols[0][row]
        return 1

    @njit(nogil=True)
    def mk_barrier(cols, row, out):
        for k in range(min(P, out.shape[0])):
            out[k] = k
        return P

    @njit(nogil=True)
    def up_value(ai, af, cols, row, key, oi, of):
        ai[0] += cols[1][row]
        return 0

    @njit(nogil=True)
    def up_barrier(ai, af, cols, row, key, oi, of):
        oi[0, 0] = ai[0]
        ai[0] = 0
        return 1

    return Operator(WA=None, WS=None, I=2, f_MK=(mk_value, mk_barrier), f_U=(up_value, up_barrier),
                    S=(("partial", "i"),), columns=((("sub", "int64"), ("v", "int64")), (("b", "int64"),)),
                    name="value_barrier.partials")


def value_barrier_totals():
    """Second operator: sums the ``partial`` rows of each barrier (tumbling windows of 1 time unit, keyed
    by the barrier's rank ``_seq`` so that two barriers with the same timestamp stay apart)."""

    @njit(nogil=True)
    def mk(cols, row, out):
        out[0] = cols[1][row]
        return 1

    @njit(nogil=True)
    def up(ai, af, cols, row, key, oi, of):
        ai[0] += cols[0][row]
        return 0

    @njit(nogil=True)
    def out(ai, af, key, l, oi, of):
        oi[0, 0] = ai[0]
        return 1

    return Operator(WA=1, WS=1, I=1, f_MK=(mk,), f_U=(up,), f_O=out, S=(("total", "i"),),
                    columns=((("partial", "int64"), ("_seq", "int64")),), name="value_barrier.totals")
