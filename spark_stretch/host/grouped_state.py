"""The drop-in's state between batches: checkpoints, restores, and key groups changing hosts
(a mixin of :class:`~.grouped.GroupedRuntime`, which has ``store``, ``kv``, ``spec``, ``B``,
``state_dir``, ``owner``, ``META`` and ``_restore_common``).

- **Checkpoints** (:meth:`GroupedState._save`): each batch's changelogs, moved into
  ``<checkpoint>/stretch/state/<N>/`` (a delta); the first one, one after a conversion and one a
  key-group move asks for are a compact copy of the store (``state.mdb.zst``: full); a delta that
  ends a chain long enough (Spark's ``minDeltasForSnapshot``) is promoted to a full one in the
  background (:meth:`GroupedState._promote`) while the next batches run.
- **Restores** (:meth:`GroupedState._load`): the full copy, then the deltas' changelogs in step
  order (:func:`restored`); a format-2 chain (pickled buckets) converted.
- **Key groups changing hosts** (:meth:`GroupedState._reshard`): a host's store rebuilt from the
  checkpoints of the same batch of the hosts that held its groups, the entries of those groups'
  buckets (a key group is the buckets ``b`` with ``pmod(b, G)`` its number).
- Keys are placed in buckets by the engine (SipHash) on one host and by Spark (``xxhash64``,
  :data:`BUCKET`) on several: a checkpoint records which (``placement``) and the key columns'
  Arrow types (``key_schema``). A query that ran on several hosts and runs on one now, or the
  other way, converts the state of the batch it continues after (:meth:`GroupedState._convert`):
  every key of the other layout's checkpoints placed again by this one's rule (Spark's
  ``xxhash64`` computed here, :func:`~spark_stretch.engine.hashing.spark_xxhash64`), on several
  hosts each host keeping its own groups'; the next checkpoint is full.
"""

from __future__ import annotations

import base64
import shutil
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..engine.keyed import KeyedStore, pickled_bucket_entries, unpack_snapshot
from ..protocol import placement
from ..protocol.placement import BUCKET
from ..protocol.errors import StateError
from ..protocol.specs import Checkpointing
from .checkpoints import CheckpointStore, read_arrow

__all__ = ["BUCKET", "GroupedState", "restored", "siphash_buckets"]

# How keys are placed in buckets: by the engine (SipHash) on one host, by Spark (xxhash64) on
# several; a checkpoint holds keys in the buckets of one of them.
_PLACEMENT = {False: "siphash", True: "xxhash64"}
FULL_COPY = "state.mdb.zst"  # a full checkpoint's copy of the store (KeyedStore.snapshot)


class GroupedState:
    """Checkpoints and restores of the drop-in's store (see the module docstring)."""

    _promoter: Optional[threading.Thread] = None  # a delta being made full (_promote)
    promoted: Optional[dict] = None  # the last promotion's outcome
    key_schema: Optional[pa.Schema] = None  # the key columns' types (from the first rows)

    def _save(self, batch: int, full: bool = False, out=None) -> None:
        """Checkpoint the state after ``batch``: the step's changelogs (a delta); the first
        time, after a conversion, or when asked (``full``: a move of key groups), a compact copy
        of the store. When a chain of deltas is long enough for a full one (Spark's
        ``minDeltasForSnapshot``, or most keys changed), the delta is written as usual and
        promoted to a full checkpoint in the background (:meth:`_promote`), so the batch does
        not wait for a copy of the whole store."""
        changes, self._changes = self._changes, []
        if not self.store.enabled:
            for _, f, _ in changes:
                f.unlink(missing_ok=True)
            return
        self.store.join()
        rows = sum(n for _, _, n in changes)
        delta = self.store.delta_due(batch, rows / max(1, self.state_keys), full)
        chain = self.store.chain
        promote = not delta and not full and chain is not None and chain["parent"] < batch
        meta = {**self._common_meta(batch), "max_event_ms": self.max_event_ms,
                "owner_map": [int(x) for x in self.owner], "epoch": self.epoch,
                "buckets": self.B, "state_keys": self.state_keys,
                "placement": _PLACEMENT[self.spec.share is not None],
                "key_schema": _schema_text(self.key_schema),
                "host_map": None if self.spec.share is None else list(self.spec.share.host_map)}
        if delta or promote:
            def files():  # (moved into the checkpoint by the store's writer thread)
                return {f.name: f for _, f, _ in changes}  # changes-<step>-<instance>.arrow
        else:
            for _, f, _ in changes:
                f.unlink(missing_ok=True)
            self._join_promotion()
            snap = self.state_dir.with_name(f"{self.state_dir.name}.snapshot")
            txn = self.kv.env.begin()  # this batch's version, whatever the next step writes

            def files():
                return {FULL_COPY: self.kv.snapshot(snap, txn)}

        self.store.save(batch, delta or promote, meta, files, {"changed_rows": rows})
        if promote:
            self.store.chain["deltas"] = 0  # (the chain starts again at this batch)
            self._promote(batch, self.kv.env.begin())

    def _promote(self, batch: int, txn) -> None:
        """Copy the store as of ``txn`` (begun after ``batch``) into the delta checkpoint of
        ``batch``, making it full, in a thread of its own while the next batches run (LMDB's
        reader sees that version whatever they write). If it fails or the engine dies
        meanwhile, the delta stays as it was: a restore follows the deltas back to the
        previous full checkpoint."""
        self._join_promotion()
        snap = self.state_dir.with_name(f"{self.state_dir.name}.promoted")
        writing = self.store._saver

        def run():
            try:
                done = self.store.promote(batch, {FULL_COPY: self.kv.snapshot(snap, txn)},
                                          writing)
                self.promoted = {"batch": batch, "done": done}
            except BaseException as e:  # (not fatal: the chain of deltas stands)
                self.promoted = {"batch": batch, "error": repr(e)}
            finally:
                snap.unlink(missing_ok=True)

        self._promoter = threading.Thread(target=run, name=f"stretch-promote-{batch}",
                                          daemon=True)
        self._promoter.start()

    def _join_promotion(self) -> None:
        if self._promoter is not None:
            self._promoter.join()
            self._promoter = None

    def _load(self, batch: int) -> None:
        """The store as the checkpoint of ``batch`` left it: its full copy, then the deltas'
        changelogs in order; a format-2 chain (pickled buckets) is converted. On several hosts,
        when this host's key groups are not those of its checkpoint: :meth:`_reshard`."""
        share = self.spec.share
        meta = self.store.read_meta(batch) if self.store.latest(batch) == batch else None
        if share is None and meta is None:  # (it ran on several hosts until then?)
            stores = _stores_of(sorted((self.store.dir.parent / "hosts").glob("*/state")),
                                batch, self.META)
            if stores:
                return self._convert(batch, stores)
        if share is not None and (meta is None or share.groups_changed(meta.get("host_map"))):
            return self._reshard(batch, meta is not None)
        self.kv, chain, converted = restored(self.store, batch, self.state_dir, self.kv_memory)
        self._check_meta(meta)
        self.key_schema = _schema_of(meta.get("key_schema")) or self.key_schema
        self._restore_common(meta)
        self.max_event_ms = meta["max_event_ms"]
        self._take_owner_map(meta)
        self.state_keys = self.kv.rows()
        # a converted state is written whole at the next checkpoint, in this version's format
        self.store.chain = None if converted else {"parent": batch, "deltas": len(chain) - 1}
        self.checkpoint = batch

    def _reshard(self, batch: int, have: bool) -> None:
        """Key groups changed hosts after ``batch`` (or this host is new to the query): this
        host's store holds the keys of its groups now, from the checkpoints of ``batch`` of
        this host (``have``: it has one) and of every host that held one of its groups then;
        the next checkpoint is full."""
        share = self.spec.share
        hosts = self.store.dir.parent.parent  # (<root>/hosts/<slot>/state)
        own, G = share.host, share.key_groups
        stores = _stores_of(sorted(hosts.glob("*/state")), batch, self.META)
        if not stores:  # (it ran on one host until then?)
            one = _stores_of([hosts.parent / "state"], batch, self.META)
            if one:
                return self._convert(batch, one)
            raise StateError(f"no host of the query has a checkpoint of batch {batch} under "
                             f"{hosts} to take key groups from")
        metas = {j: st.read_meta(batch) for j, st in stores.items()}
        for m in metas.values():
            self._check_meta(m)
        was = next(iter(metas.values()))["host_map"]
        now = share.host_map
        if was is None or len(was) != G:
            raise StateError(f"the checkpoints of batch {batch} have another number of key "
                             f"groups than spark.stretch.keyGroups ({G}): keep it the same "
                             "across restarts")
        mine_now = np.asarray(now) == own
        sources = sorted({int(w) for w, h in zip(was, now) if h == own})
        missing = [j for j in sources if j not in stores]
        if missing:
            raise StateError(f"key groups of host slot(s) {missing} have no checkpoint of "
                             f"batch {batch} under {hosts}")
        self.kv = KeyedStore(self.state_dir, self.kv_memory)
        bucket_group = np.arange(self.B) % G
        for j in sources:
            keep = (mine_now & (np.asarray(was) == j))[bucket_group]  # per bucket
            with self._source(stores[j], batch, j) as src:
                self.kv.apply(src.changelog_of(keep))
        meta = dict(metas[own]) if have else dict(next(iter(metas.values())), counters={})
        self._adopt(batch, meta, metas)
        if have:
            self._take_owner_map(meta)

    def _convert(self, batch: int, stores: Dict[int, CheckpointStore]) -> None:
        """The query ran in the other layout until ``batch`` (on several hosts and now on one,
        or the other way): this store from ``stores``' checkpoints of ``batch`` (each host's
        own groups' keys, or the one host's), every key placed again by this layout's rule
        (see the module doc); the next checkpoint is full."""
        metas = {j: st.read_meta(batch) for j, st in stores.items()}
        for m in metas.values():
            self._check_buckets(m)
            if not m.get("key_schema"):
                raise StateError(
                    f"the checkpoint of batch {batch} was written on "
                    f"{'one host' if self.spec.share else 'several hosts'} by an earlier "
                    "spark-stretch, which did not record its key columns' types, and the query "
                    f"runs on {'several' if self.spec.share else 'one'} now: the two place keys "
                    "in buckets differently. Run it where it was written (a master whose "
                    "executors are on the driver's host, or on other hosts), or start it from "
                    "a new checkpointLocation")
        self.key_schema = _schema_of(next(iter(metas.values()))["key_schema"])
        bucket_of = self._placement_rule()
        self.kv = KeyedStore(self.state_dir, self.kv_memory)
        for j, st in stores.items():
            was = metas[j].get("host_map")
            keep = (None if was is None else  # (a host's own groups then, in its buckets)
                    (np.asarray(was) == j)[np.arange(self.B) % len(was)])
            with self._source(st, batch, j) as src:
                for log in src.rebucketed(bucket_of, keep):
                    self.kv.apply(log)
        first = next(iter(metas.values()))
        self._adopt(batch, dict(first, counters={} if self.spec.share else dict(
            sum((Counter(m["counters"]) for m in metas.values()), Counter()))), metas)
        self._take_owner_map(first)

    @contextmanager
    def _source(self, store: CheckpointStore, batch: int, slot: int):
        """Host slot ``slot``'s checkpoint of ``batch`` restored beside this store, for the
        time of the ``with``."""
        tmp = self.state_dir.with_name(f"{self.state_dir.name}.from{slot}")
        src = restored(store, batch, tmp)[0]
        try:
            yield src
        finally:
            src.close()
            shutil.rmtree(tmp, ignore_errors=True)

    def _adopt(self, batch: int, meta: dict, metas: Dict[int, dict]) -> None:
        """After this store was built from the checkpoints ``metas`` of ``batch``: ``meta``'s
        figures, with the sources' latest watermarks (one watermark: a new slot's is 0) and
        event time; the next checkpoint is full."""
        meta = dict(meta)
        for k in ("watermark_ms", "next_watermark_ms"):
            meta[k] = max(m[k] for m in metas.values())
        tops = [m["max_event_ms"] for m in metas.values() if m["max_event_ms"] is not None]
        self._restore_common(meta)
        self.key_schema = _schema_of(meta.get("key_schema")) or self.key_schema
        self.max_event_ms = max(tops) if tops else None
        self.state_keys = self.kv.rows()
        self.store.chain = None
        self.checkpoint = batch

    def _placement_rule(self):
        """This layout's bucket of each key tuple: the engine's (SipHash) on one host; on
        several, Spark's ``pmod(xxhash64(k1, ...), B)`` if the key's group is this host's, else
        -1 (another host's)."""
        names = list(self.key_schema.names)
        share = self.spec.share

        def table(keys: List[tuple]) -> pa.Table:
            return pa.table([pa.array([k[i] for k in keys], type=f.type)
                             for i, f in enumerate(self.key_schema)], schema=self.key_schema)

        if share is None:
            return lambda keys: siphash_buckets(table(keys), names, self.B)
        from ..engine.hashing import spark_xxhash64

        mine = np.asarray(share.host_map) == share.host

        def several(keys: List[tuple]) -> np.ndarray:
            b = np.mod(spark_xxhash64(table(keys).columns), self.B)
            return np.where(mine[b % share.key_groups], b, -1)
        return several

    def _check_buckets(self, meta: dict) -> None:
        if int(meta["buckets"]) != self.B:
            raise StateError(f"the checkpoint has {meta['buckets']} buckets, the query "
                             f"{self.B}: keep buckets= the same across restarts")

    def _check_meta(self, meta: dict) -> None:
        """A checkpoint this run can continue: the same buckets, placed the same way."""
        self._check_buckets(meta)
        several = self.spec.share is not None
        placed = meta.get("placement", _PLACEMENT[False])
        if placed != _PLACEMENT[several]:
            raise StateError(
                "the checkpoint was written by the query on "
                f"{'several hosts' if placed == _PLACEMENT[True] else 'one host'}, and it runs "
                f"on {'several' if several else 'one'} now: the two place keys in buckets "
                "differently. Run it where it was written (a master whose executors are on "
                "the driver's host, or on other hosts), or start it from a new "
                "checkpointLocation")

    def _take_owner_map(self, meta: dict) -> None:
        self.owner = np.asarray(meta["owner_map"], dtype=np.int64)
        if self.owner.max() >= self.n:  # fewer instances than when it was written
            self.parallelism = min(self.parallelism, self.n)
            self.owner = placement.balanced_owner_map(self.B, range(self.parallelism))
        self.epoch = int(meta.get("epoch", 0))


def siphash_buckets(table: pa.Table, keys: List[str], B: int) -> np.ndarray:
    """The bucket of each row's key on one host: pandas' SipHash of the key columns (a fixed hash key, so the
    same in every process and run), placed by :func:`~spark_stretch.protocol.placement.bucket_of`."""
    import pandas as pd

    cols = {}
    for k in keys:
        col = table.column(k)
        t = col.type
        if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t) \
                or pa.types.is_duration(t):
            col = pc.cast(col, pa.int64())
        elif pa.types.is_decimal(t):
            col = pc.cast(col, pa.string())
        s = col.to_pandas()
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            s = s.astype(object)
        cols[k] = s
    h = pd.util.hash_pandas_object(pd.DataFrame(cols), index=False).to_numpy()
    return placement.bucket_of(h, B)


def _stores_of(dirs, batch: int, meta_name: str) -> Dict[int, CheckpointStore]:
    """The checkpoint stores among ``dirs`` (``<...>/hosts/<slot>/state``, or the one host's
    ``state``: slot 0) with a checkpoint of ``batch``, by slot."""
    out = {}
    for d in dirs:
        st = CheckpointStore(Checkpointing(state_dir=str(d)), meta_name)
        if st.latest(batch) == batch:
            out[int(d.parent.name) if d.parent.name.isdigit() else 0] = st
    return out


def _schema_text(schema: Optional[pa.Schema]) -> Optional[str]:
    return None if schema is None else base64.b64encode(schema.serialize().to_pybytes()).decode()


def _schema_of(text: Optional[str]) -> Optional[pa.Schema]:
    return None if not text else pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def restored(store: CheckpointStore, batch: int, dest: Path, memory: int = 0):
    """A store in ``dest`` as ``store``'s checkpoint of ``batch`` left it (its full copy, then
    the deltas' changelogs in step order; a format-2 chain converted): ``(store, the chain's
    batches, whether it was converted)``."""
    chain = store.chain_of(batch)
    metas = [store.read_meta(b) for b in chain]
    first = store.dir / str(chain[0])
    dest.mkdir(parents=True, exist_ok=True)
    for name in (FULL_COPY, "state.mdb"):  # (format 4, compressed; format 3, as LMDB wrote it)
        if (first / name).exists():
            unpack_snapshot(first / name, dest / "data.mdb")
            break
    kv = KeyedStore(dest, memory)
    kv.forget_steps()
    converted = any(int(m.get("format", 1)) == 2 for m in metas)
    if converted:  # a later checkpoint's bucket file replaces an earlier one's
        files = {f.name: f for b in chain for f in (store.dir / str(b)).glob("b*.pkl")}
        kv.load(pickled_bucket_entries(files.values()))
    else:
        for b in chain[1:]:  # in step order (a batch's instances change other buckets)
            logs = (store.dir / str(b)).glob("changes-*.arrow")
            for f in sorted(logs, key=lambda f: [int(x) for x in f.stem.split("-")[1:]]):
                kv.apply(read_arrow(f))
    return kv, chain, converted
