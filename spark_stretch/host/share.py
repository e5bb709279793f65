"""This host's share of a query that runs on several hosts: the keys of the groups it owns.

Every host's engine sees the rows routed to it (each row reaches each host that owns at least one
of its keys) or, on the files path, every row of the batch; it keeps only the keys of its own key
groups (:class:`~spark_stretch.protocol.specs.HostShare`, :mod:`spark_stretch.protocol.placement`):

- a scalar key: the rows whose key it owns;
- an array of keys: each row with only the keys it owns (a row with none is dropped), which is
  the same to an aggregation as the row with all its keys split among the hosts;
- word pairs: a pair belongs to the group of its first word, so the row keeps all its words and
  the words it does not own as a first word are flagged (``~id``, negative): the kernel forms
  no pair starting there (``engine.kernels._mk_builtin_keys``).

A key's group is Spark's ``pmod(xxhash64(key), G)`` of its content (:mod:`spark_stretch.engine.hashing`),
never of an id this engine interned, so the JVM that routes rows and every host agree.

Examples
--------
>>> import pyarrow as pa
>>> from spark_stretch.protocol.specs import HostShare
>>> from spark_stretch.host.share import KeyShare
>>> share = KeyShare(HostShare(host=0, hosts=2, key_groups=2, host_map=[0, 1]), "array", "k",
...                  "ts")
>>> t = share.keep(pa.table({"k": [["a", "b", "c"], ["b"]], "ts": [1, 2]}))
>>> t.column("k").to_pylist(), t.column("ts").to_pylist()   # 'b' is in group 1: host 1's
([['a', 'c']], [1])
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine.hashing import xxhash64
from ..protocol.placement import key_group
from ..protocol.specs import HostShare
from .columns import list_parts

__all__ = ["EventTimes", "KeyShare", "LOAD_KEY", "TOP_KEY", "group_loads", "top_ms", "tops_of"]

TOP_KEY = b"stretch.top_ms"  # (a kept batch's largest event times, before it was kept)
LOAD_KEY = b"stretch.group_load"  # (a kept batch's keys per key group: {group: keys})


def tops_of(table: pa.Table):
    """The largest event times a kept batch carries (:meth:`KeyShare.kept`), or None."""
    if not isinstance(table, pa.Table):  # (a FileBatch: one host's batch, kept as its files)
        return None
    raw = (table.schema.metadata or {}).get(TOP_KEY)
    return None if raw is None else json.loads(raw)


def group_loads(parts, share: Optional["KeyShare"]) -> Optional[np.ndarray]:
    """The keys per key group (one count per group) of a batch's kept parts (``(table,
    share)``, :meth:`KeyShare.kept`'s tables) that each part's share keeps (a source host's
    logged batch: the groups this host took from it); None on one host (no ``share``)."""
    if share is None:
        return None
    out = np.zeros(share.share.key_groups, np.int64)
    for table, mine in parts:
        raw = None if table is None else (table.schema.metadata or {}).get(LOAD_KEY)
        for g, n in (json.loads(raw) if raw is not None else {}).items():
            out[int(g)] += n if mine.mine[int(g)] else 0
    return out


def top_ms(table: pa.Table, ts_column: str):
    """A batch's largest event time (ms; None: none), before a host keeps its share of the rows
    (every row's event time counts for the one watermark of all hosts)."""
    top = pc.max(pc.cast(table.column(ts_column), pa.int64())).as_py()
    return None if top is None else top // 1000


class KeyShare:
    """Keeps a batch's keys of this host's key groups (``key_kind``: ``scalar``, ``array`` or
    ``pairs``, of the key column ``key_column``)."""

    def __init__(self, share: HostShare, key_kind: str, key_column: str, ts_column: str,
                 mine: np.ndarray = None):
        self.share = share
        self.key_kind = key_kind
        self.key_column = key_column
        self.ts_column = ts_column
        if mine is None:  # (else the groups to keep: a source's while they change hosts)
            mine = np.zeros(share.key_groups, np.bool_)
            mine[share.owned()] = True
        self.mine = np.asarray(mine, np.bool_)

    def of_source(self, source_map, source: int) -> "KeyShare":
        """What this host keeps of the input logged by host ``source`` under its host map
        ``source_map``: the keys of groups that were the source's and are this host's now."""
        was = np.asarray(source_map) == source
        return KeyShare(self.share, self.key_kind, self.key_column, self.ts_column,
                        self.mine & was)

    def kept(self, table: pa.Table) -> pa.Table:
        """:meth:`keep`, with the batch's largest event time before it in the table's schema
        metadata (``stretch.top_ms``): every row's event time counts for the one watermark;
        and the keys it keeps per key group (``stretch.group_load``; a pair: its first word),
        the groups' loads a controller moves groups between hosts by."""
        top = top_ms(table, self.ts_column)
        table, load = self._keep(table)
        meta = dict(table.schema.metadata or {})
        meta[TOP_KEY] = json.dumps([top]).encode()
        meta[LOAD_KEY] = json.dumps({int(g): int(load[g]) for g in np.flatnonzero(load)}).encode()
        return table.replace_schema_metadata(meta)

    def is_mine(self, keys: pa.Array) -> np.ndarray:
        """Whether each key of ``keys`` (content, not ids) is in a group this host owns."""
        return self._mine(keys)[0]

    def _mine(self, keys: pa.Array):
        """``(is_mine, keys of each group it owns)`` of ``keys``."""
        groups = key_group(xxhash64(keys), self.share.key_groups)
        mine = self.mine[groups]
        return mine, np.bincount(groups[mine], minlength=self.share.key_groups)

    def keep(self, table: pa.Table) -> pa.Table:
        """``table`` with only what this host keeps of it (pairs: all their rows, see
        :meth:`flag_firsts`)."""
        return self._keep(table)[0]

    def _keep(self, table: pa.Table):
        """:meth:`keep`'s table, and the keys it keeps per key group."""
        i = table.schema.get_field_index(self.key_column)
        col = table.column(i).combine_chunks()
        if self.key_kind == "scalar":
            mine, load = self._mine(col)
            return table.filter(pa.array(mine)), load
        offsets, values = list_parts(col)
        mine, load = self._mine(values)
        if self.key_kind == "pairs":
            return table, load
        kept = np.concatenate([[0], np.cumsum(mine)])[offsets]
        lists = pa.ListArray.from_arrays(pa.array(kept.astype(np.int32)), values.filter(mine))
        return table.set_column(i, table.field(i).with_type(lists.type), lists) \
            .filter(pa.array(kept[1:] > kept[:-1])), load

    def flag_firsts(self, ids: np.ndarray, words: pa.Array) -> np.ndarray:
        """Pair keys: the interned ``ids`` of a batch's ``words``, those this host does not own
        flagged as ``~id`` (no pair of this host starts with them)."""
        return np.where(self.is_mine(words), ids, ~ids)


class EventTimes:
    """A runtime's largest event time per input stream (``stream_max_ms``, ms), which its
    watermark follows (``_next_watermark``), with every host's folded in on several hosts."""

    stream_max_ms: list

    def _saw(self, s: int, top) -> None:
        """Stream ``s``'s largest event time so far (ms) takes ``top`` (None: no rows) in."""
        seen = self.stream_max_ms[s]
        if top is not None:
            self.stream_max_ms[s] = top if seen is None else max(seen, top)

    def _next_watermark(self) -> int:
        """Spark's global watermark after this batch (``WatermarkTracker``): each stream's is
        its largest event time minus its delay (0 before it has seen data), the global one the
        min of them (``spark.sql.streaming.multipleWatermarkPolicy=max``: the max), never moving
        back."""
        per = [0 if top is None else top - delay
               for top, delay in zip(self.stream_max_ms, self._delays())]
        pick = max if getattr(self.spec, "watermark_policy", "min") == "max" else min
        return max(self.watermark_ms, self.next_watermark_ms, pick(per))

    def fold_event_times(self, stream_max_ms) -> None:
        """A query on several hosts: every host's largest event times up to the last batch
        (the driver's), so this host's W_N is the one watermark of all."""
        for s, top in enumerate(stream_max_ms):
            self._saw(s, top)
        self.next_watermark_ms = self._next_watermark()

    def take_watermark(self, watermark_ms: int) -> None:
        """Spark's watermark for the next step as W_N: where the input is not all Spark's
        watermark follows (another aggregation's windows, one of several streams), the two
        differ, and Spark's decides, as for Spark's own state operator."""
        self.next_watermark_ms = max(int(watermark_ms), self.watermark_ms)
