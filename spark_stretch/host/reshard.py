"""Key groups that change hosts: a host's state rebuilt from the hosts' checkpoints.

A query on several hosts moves key groups between hosts at a batch boundary (``reconfigure(
key_groups=...)``), restores a lost host's groups on the others, or restarts on another host
map: in each case every host has a full checkpoint of the same batch ``N`` written under the
old host map (each holding the keys of its own groups), and each host whose groups changed
builds its state under the new map from its own and those of the hosts it takes groups from
(the sources), keeping what it owns now:

- **windows**: the live window records of every source whose key is in one of its new groups,
  their keys (and the interned string values some aggregates keep) mapped to this host's ids,
  each re-inserted in the bucket of its key;
- **tuples waiting in the ESG** for the watermark: each source's, with only the keys this host
  owns now (an array key's elements; a scalar key's rows; a pair's first word, the others
  flagged ``~id`` as :mod:`.share` does), which to an aggregation is the tuple split by host.

Watermarks, owner map and epoch are this host's own (the watermark is the same on every host).
No window is in two sources (a key's group had one host), so the union is exact. A key's group
is computed from its content (:mod:`spark_stretch.engine.hashing`), never from a source's ids.
"""

from __future__ import annotations

import json
import pickle
from typing import List

import numpy as np
import pyarrow as pa

from ..engine import Interner, ListColumn, engine_class
from ..engine import kernels as K
from ..engine.state import BucketState
from ..protocol.errors import StateError
from ..protocol.placement import bucket_of
from ..protocol.specs import AggregateSpec, Checkpointing
from .aggregations import check_keys, engine_agg
from ..protocol.layout import input_log_of
from .checkpoints import CheckpointStore
from .input_log import InputLog, LoggedFiles
from .columns import NULL_LONG_KEY, KeyCodec
from .share import KeyShare

__all__ = ["Resharding", "load_resharded"]


def _source(state_dir: str, meta_name: str, batch: int):
    """One host's checkpoint of ``batch``: (meta, interned strings, per operator its snapshot
    chain as bytes)."""
    store = CheckpointStore(Checkpointing(state_dir=state_dir), meta_name)
    chain = store.chain_of(batch)
    dirs = [store.dir / str(b) for b in chain]
    strings: list = []
    for d in dirs:
        part = json.loads((d / meta_name).read_text())
        if part.get("strings_from", 0) != len(strings):
            raise StateError(f"engine checkpoint {d} does not continue {dirs[0]} (interner)")
        strings += pickle.loads((d / "interner.pkl").read_bytes())
    n = len(list(dirs[0].glob("engine*.snap")))
    snaps = [((dirs[0] / f"engine{i}.snap").read_bytes(),
              [(d / f"engine{i}.snap").read_bytes() for d in dirs[1:]]) for i in range(n)]
    return store.read_meta(batch), strings, snaps


def _string_slots(spec: AggregateSpec) -> List[int]:
    """The aggregates (``q``) whose int slot holds an interned string's id."""
    return [q for q, a in enumerate(spec.aggs)
            if (lambda fn, col, _: col is not None and spec.value_types.get(col) == "string"
                and fn not in ("count", "hll_word"))(*engine_agg(a))]


class _Mapping:
    """A source's ids in this host's interner, and which of its keys this host now owns."""

    def __init__(self, strings: list, codec: KeyCodec, share: KeyShare, spec: AggregateSpec):
        self.n = len(strings)
        self.share = share
        self.interned = spec.key_kind != "scalar" or spec.key_type in ("string", "binary")
        self.nullable = spec.key_nullable
        self.ids = np.empty(self.n, np.int64)
        # (the interner keeps a composite key's bytes and a string value's text apart: each is
        # interned again as what it was; a key's content is its bytes either way)
        raw = np.fromiter((isinstance(x, bytes) for x in strings), np.bool_, self.n)
        for sel, typ in ((raw, pa.binary()), (~raw, pa.string())):
            if sel.any():
                self.ids[sel] = codec.ids(pa.array([x for x, r in zip(strings, raw)
                                                    if r == (typ == pa.binary())], typ),
                                          force_intern=True)
        content = pa.array([x if isinstance(x, bytes) else x.encode() for x in strings],
                           pa.binary())
        self.mine = share.is_mine(content) if self.n else np.empty(0, np.bool_)

    def ids_of(self, v: np.ndarray) -> np.ndarray:
        """Source ids to this host's (values that are no id of the source left as they are)."""
        if not self.n:
            return v
        ok = (v >= 0) & (v < self.n)
        return np.where(ok, self.ids[np.clip(v, 0, self.n - 1)], v)

    def owned(self, keys: np.ndarray) -> np.ndarray:
        if self.interned:
            out = self.mine[np.maximum(keys, 0)] if self.n else np.zeros(len(keys), np.bool_)
            if self.nullable:  # (the null key, -1: the group of a null)
                out[keys < 0] = self.share.is_mine(pa.nulls(1, pa.string()))[0]
            return out
        mask = keys == NULL_LONG_KEY if self.nullable else None
        return self.share.is_mine(pa.array(keys, pa.int64(), mask=mask))


def _records(rec, acc_f, m: _Mapping, spec: AggregateSpec, base: int):
    """A source's live window records this host owns now, in its ids (and which they were)."""
    key = rec[:, 0]
    first = key >> 32 if spec.key_kind == "pairs" else key
    keep = m.owned(first)
    rec, acc_f = rec[keep].copy(), acc_f[keep]
    if m.interned:
        if spec.key_kind == "pairs":
            rec[:, 0] = (m.ids_of(rec[:, 0] >> 32) << 32) | m.ids_of(rec[:, 0] & 0xFFFFFFFF)
        else:
            rec[:, 0] = m.ids_of(rec[:, 0])
    for q in _string_slots(spec):
        rec[:, base + q] = m.ids_of(rec[:, base + q])
    return rec, acc_f, keep


def _chunk(c: dict, m: _Mapping, spec: AggregateSpec):
    """A source's waiting tuples (an ESG chunk) with only the keys this host owns now, in its
    ids (None: none left)."""
    strings = [col for col, t in spec.value_types.items() if t == "string"]
    key = c["key"]
    if isinstance(key, ListColumn):
        vals, offsets = key.values, key.offsets
        if spec.key_kind == "pairs":  # (flagged ~id: a first word of another host)
            raw = np.where(vals >= 0, vals, ~vals)
            mine = (vals >= 0) & m.owned(raw)
            new = m.ids_of(raw)
            key = ListColumn(offsets, np.where(mine, new, ~new))
        else:
            mine = m.owned(vals)
            cm = np.concatenate([[0], np.cumsum(mine)])
            key = ListColumn(cm[offsets], m.ids_of(vals[mine]) if m.interned else vals[mine])
        cm = np.concatenate([[0], np.cumsum(mine)])
        rows = np.flatnonzero(cm[offsets[1:]] > cm[offsets[:-1]])
    else:
        rows = np.flatnonzero(m.owned(key))
        key = m.ids_of(key) if m.interned else key
    if not len(rows):
        return None
    out = {}
    for name, col in c.items():
        v = key if name == "key" else col
        v = v.take(rows) if isinstance(v, ListColumn) else v[rows]
        out[name] = m.ids_of(v) if name in strings else v
    return out


def load_resharded(spec: AggregateSpec, sources: List[str], meta_name: str, batch: int,
                   ops: list, own: int, spill=None):
    """This host's state after ``batch`` under ``spec.share``'s host map, from every host's
    checkpoint of that batch (``sources``: their state directories, host order; ``own``: this
    host's, or None: a host new to the query, whose state is all the others'). Returns
    ``(engines, codec, metas)``: each source's checkpoint meta. ``spill``: the engines' memory
    budget (:class:`~spark_stretch.engine.spill.Spill`)."""
    share = KeyShare(spec.share, spec.key_kind, spec.key_column, spec.ts_column)
    loaded = [_source(d, meta_name, batch) for d in sources]
    strings = [] if own is None else loaded[own][1]
    codec = KeyCodec(Interner(strings))  # (its own ids stay; the others' strings join them)
    base = 0 if own is None else own  # (the engine restored: its owner map, epoch, ESG)
    maps = [_Mapping(s, codec, share, spec) for _, s, _ in loaded]
    engines = []
    for i, op in enumerate(ops):
        cls = engine_class(op)
        parts = [cls.restore(op, snap[i][0], threads=(j == base), deltas=snap[i][1])
                 for j, (_, _, snap) in enumerate(loaded)]
        mine = parts[base]
        base = 4 if op.session_end else 2
        recs, accs, words = [], [], []
        for eng, m in zip(parts, maps):
            c = eng.state.compact()  # (a window's register-pool row, if any: its words)
            r, a, keep = _records(c["rec"], c["acc_f"], m, spec, base)
            recs.append(r)
            accs.append(a)
            words.append(c["pool"][1][keep] if c["pool"][0] else c["pool"][1])
        rec, acc = np.concatenate(recs), np.concatenate(accs)
        st = mine.state
        pool = c["pool"]
        for sl in pool[0]:  # (record i holds the pool row i of the words below)
            rec[:, sl] = np.arange(len(rec))
        b = bucket_of(rec[:, 0], st.n_buckets)
        counts = np.bincount(b, minlength=st.n_buckets)
        cap = max(st.cap, int(counts.max(initial=0)) * 3 // 2 + 8)  # (the fullest: 2/3 full)
        bminl = np.full(st.n_buckets, K.NO_L, np.int64)
        np.minimum.at(bminl, b, rec[:, 1])
        mine.spill = spill
        mine.state = BucketState.from_compact({
            "cap": cap, "only": None, "b": b, "rec": rec, "acc_f": acc,
            "bcount": counts.astype(st.bcount.dtype), "bminl": bminl.astype(st.bminl.dtype),
            "init_i": st.init_i, "init_f": st.init_f,
            "pool": (pool[0], np.concatenate(words), pool[2])}, spill)
        mine.state.dirty[:] = 1  # (its next checkpoint is full: the state is new)
        snap_in = mine.esg_in.snapshot()
        for s_id, (stream, ordered, last_ts, wm, _, removed) in list(snap_in["sources"].items()):
            chunks = []
            for eng, m in zip(parts, maps):
                src = eng.esg_in.snapshot()["sources"].get(s_id)
                if src is None:
                    continue
                last_ts = max(last_ts, src[2])
                for c in src[4]:
                    got = _chunk(c, m, spec)
                    if got is not None:
                        chunks.append(got)
            snap_in["sources"][s_id] = (stream, ordered, last_ts, wm, chunks, removed)
        mine.esg_in.restore(snap_in)
        engines.append(mine)
    return engines, codec, [m for m, _, _ in loaded]


class Resharding:
    """What a runtime (:class:`~.aggregate.AggregateRuntime`) does when its key groups changed
    hosts since its checkpoint: its state from every slot's checkpoint, and the batches after
    it from every slot's input log (a mixin: the runtime has ``store``, ``spec``, ``share``,
    ``codec``, ``counters``, ``sources``, ``META``, ``_restore_common`` and ``_spill``)."""

    def _resharded(self, batch: int, ops) -> list:
        """Key groups changed hosts after ``batch`` (its checkpoint has another host map): this
        host's groups now, from every host's checkpoint (:mod:`.reshard`); the next is full."""
        hosts = self.store.dir.parent.parent  # (<root>/hosts/<slot>/state)
        own = self.spec.share.host
        have = self.store.latest(batch) == batch
        was = self._old_host_map(hosts, batch)
        # The sources: this host's own checkpoint and those of the slots that held a group it
        # holds now; no other checkpoint has a window or waiting tuple of its keys.
        now = self.spec.share.host_map
        slots = sorted({w for w, h in zip(was, now) if h == own} | ({own} if have else set()))
        dirs = [hosts / str(j) / "state" for j in slots]
        engines, self.codec, metas = load_resharded(self.spec, [str(d) for d in dirs],
                                                    self.META, batch, ops,
                                                    slots.index(own) if have else None,
                                                    **self._spill())
        # the batches after it, from every source's input log (a lost host's too)
        self.sources = [(InputLog(input_log_of(d)), self.share.of_source(m["host_map"], j))
                        for j, d, m in zip(slots, dirs, metas)]
        for m in metas:
            check_keys(self.spec, m, batch)
        meta = dict(metas[slots.index(own)]) if have else dict(metas[0], counters={})
        for k in ("watermark_ms", "next_watermark_ms"):  # (one watermark: a new slot's is 0)
            meta[k] = max(m[k] for m in metas)
        self._restore_common(meta)
        self.stream_max_ms, self.store.chain = meta.get("stream_max_ms", [None]), None
        return engines

    def _old_host_map(self, hosts, batch: int) -> list:
        """The host map the checkpoints of ``batch`` were written under (its own, or another
        slot's for a host new to the query)."""
        if self.store.latest(batch) == batch:
            return self.store.read_meta(batch)["host_map"]
        for d in sorted(hosts.glob("*/state")):
            meta = d / str(batch) / self.META
            if meta.exists():
                return json.loads(meta.read_text())["host_map"]
        raise StateError(f"no host of the query has a checkpoint of batch {batch} under {hosts} "
                         "to take key groups from")

    def _logged(self, batch: int):
        if not self.sources:
            return super()._logged(batch)
        read = [log.read(batch, extra=True) for log, _ in self.sources]
        if any(isinstance(t, LoggedFiles) for t, _ in read):  # (written on one host only)
            raise StateError(f"batch {batch} was logged by its files on one host, not by its "
                             "rows, which key groups moving between hosts need: restart the "
                             "query on one host")
        # (the driver's decisions are the same in every log)
        extra = next((e for _, e in read if e), {})
        return [(t, share) for (t, _), (_, share) in zip(read, self.sources)], extra
