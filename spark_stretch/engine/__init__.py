"""The VSN engine: ESG, shared buckets, owner map, epochs and O+ operators. No Spark import here.

Public API::

    Engine(op, m, n, n_buckets=1024, esg_in=None, threads=True)  # setup(O+, m, n) as an object
    setup(op, m, n, esg_in=None, **kw) -> (esg_in, esg_out)     # the paper's setup; esg_out.engine is the Engine
    reconfigure(esg, m=None, instances=None, owner_map=None) -> epoch
    SNEngine(...)                                                 # shared-nothing baseline, same API
    JoinEngine(...) / JoinOperator                                # I = 2 joins over a per-bucket tuple store
    ESG, Segment, Control, ListColumn, Interner, Operator, EngineError

Modules: :mod:`.runtime` (``Engine``: the step loop and its threads), :mod:`.epochs`
(reconfiguration), :mod:`.snapshot` (checkpoints), :mod:`.esg` (the ready-tuple buffer),
:mod:`.batch` (columnar batches), :mod:`.kernels` (the jitted VSN kernel), :mod:`.buckets`
(keys to buckets, the buckets' window tables), :mod:`.aggregates` (the built-in aggregates'
arithmetic), :mod:`.sessions` (session windows), :mod:`.state` (shared state, owner maps,
interning), :mod:`.sn` and :mod:`.store` (the shared-nothing and join engines), :mod:`.jitcache`
(numba's on-disk cache kept in step with the sources), :mod:`.jit` (the kernels' ``njit``:
numba's, or the native library :mod:`.aot` built ahead of time, loaded by :mod:`.native`
without numba).
"""
from pathlib import Path as _Path

from . import jit as _jit
from .jitcache import cache_runtime as _cache_runtime, purge_stale as _purge_stale

if _jit.numba_loaded():  # (with the kernels' library: when numba is needed, jit does these)
    _purge_stale(_Path(__file__).parent)  # before any kernel is defined: numba's cache in step
    _cache_runtime(_Path(__file__).parent)  # numba's runtime loaded, not compiled (jitcache)
from .errors import EngineError  # noqa: E402
from .batch import ListColumn, to_arrow
from .esg import ESG, Control, Segment
from .operator import Operator
from .reference import reference_run
from .factory import engine_class, setup
from .epochs import reconfigure
from .runtime import Engine
from .sn import SNEngine
from .store import JoinEngine, JoinOperator
from .state import BucketState, Interner, balanced_owner_map

__all__ = ["Engine", "SNEngine", "JoinEngine", "JoinOperator", "engine_class", "setup", "reconfigure", "ESG", "Segment", "Control", "ListColumn",
           "Interner", "Operator", "EngineError", "BucketState", "balanced_owner_map", "reference_run",
           "to_arrow"]
