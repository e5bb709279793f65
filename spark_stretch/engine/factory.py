"""Which engine class runs an operator, and the paper's ``setup`` (stretch-tpds §7).

The one module that knows every engine class: :class:`~.runtime.Engine` (VSN), the
shared-nothing baseline :class:`~.sn.SNEngine` and :class:`~.store.JoinEngine` (J+, I = 2). The
classes build on ``runtime`` and never import this module, so the engine's imports form no
circle. An operator says which engine it needs with its ``engine_kind`` (``"vsn"``, ``"join"``).

Examples
--------
>>> from spark_stretch.engine.factory import engine_class
>>> from spark_stretch.ops import band_join, wordcount
>>> engine_class(wordcount(WS=60, WA=60)).__name__, engine_class(band_join(WS=10)).__name__
('Engine', 'JoinEngine')
"""
from __future__ import annotations

from .errors import EngineError
from .runtime import Engine
from .sn import SNEngine
from .store import JoinEngine

__all__ = ["engine_class", "setup"]


def engine_class(op, shared_nothing=False):
    """The engine class running ``op``: :class:`Engine`, ``SNEngine`` or ``JoinEngine``."""
    if getattr(op, "engine_kind", "vsn") == "join":
        if shared_nothing:
            raise EngineError("the shared-nothing mode runs aggregations only, not JoinOperator")
        return JoinEngine
    return SNEngine if shared_nothing else Engine


def setup(op, m, n, esg_in=None, **kw):
    """``{ESG_in, ESG_out} = setup(O+, m, n)`` (stretch-tpds §7). ``esg_out.engine`` is the :class:`Engine`.

    With ``esg_in`` (an upstream operator's ``esg_out``) this is the paper's ``setup(ESG_in, O+, m, n)``.
    """
    eng = engine_class(op)(op, m, n, esg_in=esg_in, **kw)
    return eng.esg_in, eng.esg_out
