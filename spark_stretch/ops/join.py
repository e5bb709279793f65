"""Joins with I = 2 as O+ / J+ operators (stretch-tpds Appendix D, Operator 10; §8.6 Q6).

- :func:`band_join`: ScaleJoin's band join, ``|x - a| <= 10 and |y - b| <= 10`` within ``WS``.
- :func:`hedge_join`: the NYSE hedge self-join of Q6: ``r.id != l.id and c <= ND_r / ND_l`` with
  ``ND = (price - avg) / avg`` and ``c = -1.05`` (the paper's predicate, as written).

Examples
--------
>>> op = band_join(WS=100)
>>> [c for c, _ in op.S]
['l_x', 'l_y', 'r_a', 'r_b']
"""
from __future__ import annotations

from ..engine.store import PRED_BAND, PRED_HEDGE, JoinOperator


def band_join(WS, dx=10.0, dy=10.0, left=("x", "y"), right=("a", "b"), shares=16):
    """Band join of stream 0 ``(x, y)`` and stream 1 ``(a, b)``: ``|x-a| <= dx and |y-b| <= dy``."""
    return JoinOperator(WS=WS, left=tuple(left), right=tuple(right), shares=shares, pred=PRED_BAND,
                        fp=(float(dx), float(dy)), name="band_join")


def hedge_join(WS, c=-1.05, columns=("id", "price", "avg"), shares=16):
    """NYSE hedge self-join (Q6): feed the same trades as stream 0 and stream 1."""
    return JoinOperator(WS=WS, left=tuple(columns), right=tuple(columns), shares=shares, pred=PRED_HEDGE,
                        fp=(float(c),), name="hedge_join")


def join(WS, left, right, pred, shares=16, fp=()):
    """A J+ with a user numba predicate ``pred(left_payload, right_payload, ip, fp) -> bool``."""
    return JoinOperator(WS=WS, left=tuple(left), right=tuple(right), shares=shares, pred=pred, fp=tuple(fp),
                        name=getattr(pred, "__name__", "join"))
