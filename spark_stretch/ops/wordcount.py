"""Word count and pair count (stretch-tpds Q1, Operator 14): A+ operators over a tweet's word list.

A tweet is stored once (ts, offsets, flat word ids); ``f_MK`` runs inside the kernel: every word (word
count) or every ordered pair ``(w[i], w[j])``, ``i < j <= i + B`` (pair count, key ``(w[i] << 32) | w[j]``).
Counts are per occurrence, like Spark's ``explode(words)`` + ``groupBy(window, word).count()``.

Examples
--------
>>> op = paircount(B=3, WS=60)
>>> op.name
'count(words, pairs B=3)'
"""
from __future__ import annotations

from .aggregate import aggregate


def wordcount(WS, WA=None, column="words"):
    """Windowed count of every word of the list column ``column``."""
    return aggregate("count", keys=column, WS=WS, WA=WA)


def paircount(B=None, WS=60, WA=None, column="words"):
    """Windowed count of word pairs at distance ``<= B`` (``B=None``: unbounded) in ``column``."""
    return aggregate("count", keys=column, pairs=True, B=B, WS=WS, WA=WA)
