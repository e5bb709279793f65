"""Reconfiguration of an :class:`~spark_stretch.engine.runtime.Engine`: epochs (stretch-tpds §7,
Alg. 4-6).

A reconfiguration provisions, decommissions or rebalances instances from the next ready tuple
on: :meth:`Epochs.reconfigure` appends a :class:`~spark_stretch.engine.esg.Control` tuple (the
new epoch, its active instances and owner map) to ESG_in; the instances process everything
before it under the old owner map, meet at a barrier, and :meth:`Epochs._apply_control`
switches: readers and sources connected or disconnected, the owner map swapped. No state is
copied (the shared-nothing engine's :meth:`_transfer_state` copies buckets).

:class:`Epochs` is a part of :class:`~spark_stretch.engine.runtime.Engine` (a base class of
it): it reads and sets the engine's ``active``, ``owner_map``, ``epoch``, ESGs and locks.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .errors import EngineError
from .esg import Control
from .state import balanced_owner_map, validate_owner_map


def _check_mn(m, n):
    for name, v in (("m", m), ("n", n)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise EngineError(f"{name}={v!r}; parallelism must be a positive int")
    if m > n:
        raise EngineError(f"m={m} > n={n}: initial parallelism m must not exceed max parallelism n")


class Epochs:
    """Epoch switches of an engine (mixed into :class:`~spark_stretch.engine.runtime.Engine`)."""

    def reconfigure(self, m=None, instances=None, owner_map=None) -> int:
        """Provision, decommission or rebalance from the next ready tuple on (Alg. 4-6).

        Parameters
        ----------
        m : int, optional
            New parallelism: the active instances are the first m of ``range(n)``.
        instances : iterable of int, optional
            New active instance set (ids in ``range(n)``); default: the current one (or from ``m``).
        owner_map : array of int, optional
            New owner of each of the B buckets (every owner an active instance); default: balanced.

        Returns the new epoch number. In driven mode the switch happens in the next :meth:`drain`.
        """
        if m is not None and instances is not None:
            raise EngineError("give m= or instances=, not both")
        if m is not None:
            _check_mn(m, self.n)
            instances = range(m)
        if instances is None:
            instances = self._pending_instances()
        inst = sorted(set(int(i) for i in instances))
        if not inst:
            raise EngineError("instances is empty; an epoch needs at least one active instance")
        bad = [i for i in inst if not 0 <= i < self.n]
        if bad:
            raise EngineError(f"instances {bad} are not in range(n={self.n}); ids of the n created instances are 0..{self.n - 1}")
        om = balanced_owner_map(self.n_buckets, inst) if owner_map is None else \
            validate_owner_map(owner_map, self.n_buckets, inst)
        with self._drain_lock:
            self._next_epoch = getattr(self, "_next_epoch", self.epoch) + 1
            self._next_instances = inst
            old = self._pending_old()
            ctl = Control(self._next_epoch, tuple(inst), om.copy(), 0)
            ctl.barrier = threading.Barrier(len(old), action=lambda: self._apply_control(ctl, lead=min(old)))
            self._pending_old_set = inst
            self.esg_in.add_control(ctl)
        return ctl.epoch

    def _pending_instances(self):
        return getattr(self, "_next_instances", None) or list(self.active)

    def _pending_old(self):
        return getattr(self, "_pending_old_set", None) or list(self.active)

    def _apply_control(self, ctl, lead):
        """Switch epoch (Alg. 4 L11-14): connect provisioned / disconnect decommissioned instances, swap f_mu."""
        t0 = time.perf_counter()
        old, new = set(self.active), set(ctl.instances)
        add, rem = sorted(new - old), sorted(old - new)
        if add:
            self.esg_out.add_sources(add, ordered=False)
            self.esg_in.add_readers(add, j=lead)
        if rem:
            self.esg_in.remove_readers(rem)
            self.esg_out.remove_sources(rem)
        self._transfer_state(ctl.owner_map)
        self.owner_map = ctl.owner_map
        self.active = sorted(new)
        self.epoch = ctl.epoch
        self._m["epoch_switches"] += 1
        self._m["last_switch_ms"] = (time.perf_counter() - t0) * 1e3
        ctl.applied.set()
        with self._idle:
            self._idle.notify_all()

    def _transfer_state(self, new_owner_map):
        """VSN: nothing to move (state is shared). The shared-nothing engine copies buckets here."""

    @property
    def pool(self):
        return [j for j in range(self.n) if j not in self.active]


def reconfigure(esg, m=None, instances=None, owner_map=None):
    """``reconfigure`` of the operator that owns ``esg`` (its ESG_in or ESG_out); see :meth:`Engine.reconfigure`."""
    if esg.engine is None:
        raise EngineError(f"ESG '{esg.name}' belongs to no engine; pass the esg_in/esg_out returned by setup()")
    return esg.engine.reconfigure(m=m, instances=instances, owner_map=owner_map)
