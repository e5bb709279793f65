"""The drop-in's state between batches: checkpoints, restores, and key groups changing hosts
(a mixin of :class:`~.grouped.GroupedRuntime`, which has ``store``, ``kv``, ``spec``, ``B``,
``state_dir``, ``owner``, ``META`` and ``_restore_common``).

- **Checkpoints** (:meth:`GroupedState._save`): each batch's changelogs, moved into
  ``<checkpoint>/stretch/state/<N>/`` (a delta); the first one, one after a conversion and one a
  key-group move asks for are a compact copy of the store (``state.mdb``: full); a delta that
  ends a chain long enough (Spark's ``minDeltasForSnapshot``) is promoted to a full one in the
  background (:meth:`GroupedState._promote`) while the next batches run.
- **Restores** (:meth:`GroupedState._load`): the full copy, then the deltas' changelogs in step
  order (:func:`restored`); a format-2 chain (pickled buckets) converted.
- **Key groups changing hosts** (:meth:`GroupedState._reshard`): a host's store rebuilt from the
  checkpoints of the same batch of the hosts that held its groups, the entries of those groups'
  buckets (a key group is the buckets ``b`` with ``pmod(b, G)`` its number).
- Keys are placed in buckets by the engine (SipHash) on one host and by Spark (``xxhash64``,
  :data:`BUCKET`) on several: a checkpoint records which (``placement``), and a run of the other
  kind refuses it.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from ..engine.keyed import KeyedStore, pickled_bucket_entries
from ..protocol import placement
from ..protocol.placement import BUCKET
from ..protocol.errors import StateError
from ..protocol.specs import Checkpointing
from .checkpoints import CheckpointStore, read_arrow

__all__ = ["BUCKET", "GroupedState", "restored"]

# How keys are placed in buckets: by the engine (SipHash) on one host, by Spark (xxhash64) on
# several; a checkpoint holds keys in the buckets of one of them.
_PLACEMENT = {False: "siphash", True: "xxhash64"}


class GroupedState:
    """Checkpoints and restores of the drop-in's store (see the module docstring)."""

    _promoter: Optional[threading.Thread] = None  # a delta being made full (_promote)
    promoted: Optional[dict] = None  # the last promotion's outcome

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
                return {"state.mdb": self.kv.snapshot(snap, txn)}

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
                done = self.store.promote(batch, {"state.mdb": self.kv.snapshot(snap, txn)},
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
        if share is not None and (meta is None or share.groups_changed(meta.get("host_map"))):
            return self._reshard(batch, meta is not None)
        self.kv, chain, converted = restored(self.store, batch, self.state_dir)
        self._check_meta(meta)
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
        stores = {}
        for d in sorted(hosts.glob("*/state")):
            st = CheckpointStore(Checkpointing(state_dir=str(d)), self.META)
            if st.latest(batch) == batch:
                stores[int(d.parent.name)] = st
        if not stores:
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
        self.kv = KeyedStore(self.state_dir)
        bucket_group = np.arange(self.B) % G
        for j in sources:
            keep = (mine_now & (np.asarray(was) == j))[bucket_group]  # per bucket
            tmp = self.state_dir.with_name(f"{self.state_dir.name}.from{j}")
            src = restored(stores[j], batch, tmp)[0]
            try:
                self.kv.apply(src.changelog_of(keep))
            finally:
                src.close()
                shutil.rmtree(tmp, ignore_errors=True)
        meta = dict(metas[own]) if have else dict(next(iter(metas.values())), counters={})
        for k in ("watermark_ms", "next_watermark_ms"):  # (one watermark: a new slot's is 0)
            meta[k] = max(m[k] for m in metas.values())
        tops = [m["max_event_ms"] for m in metas.values() if m["max_event_ms"] is not None]
        self._restore_common(meta)
        self.max_event_ms = max(tops) if tops else None
        if have:
            self._take_owner_map(meta)
        self.state_keys = self.kv.rows()
        self.store.chain = None
        self.checkpoint = batch

    def _check_meta(self, meta: dict) -> None:
        """A checkpoint this run can continue: the same buckets, placed the same way."""
        if int(meta["buckets"]) != self.B:
            raise StateError(f"the checkpoint has {meta['buckets']} buckets, the query "
                             f"{self.B}: keep buckets= the same across restarts")
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


def restored(store: CheckpointStore, batch: int, dest: Path):
    """A store in ``dest`` as ``store``'s checkpoint of ``batch`` left it (its full copy, then
    the deltas' changelogs in step order; a format-2 chain converted): ``(store, the chain's
    batches, whether it was converted)``."""
    chain = store.chain_of(batch)
    metas = [store.read_meta(b) for b in chain]
    first = store.dir / str(chain[0])
    dest.mkdir(parents=True, exist_ok=True)
    if (first / "state.mdb").exists():
        shutil.copyfile(first / "state.mdb", dest / "data.mdb")
    kv = KeyedStore(dest)
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
