"""How one request becomes a request to every host's engine, and their replies one reply.

:class:`FanOut` is the request half of :class:`~.cluster.ClusterEngine` (see its module
docstring): ``call(msg)`` sends ``msg`` to every host in parallel (or what the request needs
instead: ``open`` gives each host its share, ``write_delta`` is every host's data files and one
commit) and merges the replies into the reply one host would give.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Union

from ..protocol import messages as M
from ..protocol.layout import write_json
from ..protocol.placement import balanced_host_map, host_map_of_counts, validate_host_map
from ..protocol.specs import AggregateSpec, GroupedSpec, HostShare, spec_from_wire, spec_to_wire
from .engine import EngineDiedError
from .settings import read_settings

__all__ = ["FanOut"]


@dataclass
class _Query:
    """What the handle keeps per open query: its host map, what each host replays, and the
    largest event time of every input stream over all hosts."""

    share: HostShare
    replay: List[List[int]]
    key_kind: str  # ("grouped": the drop-in's, routed by bucket)
    key_column: Union[str, List[str]]  # (the drop-in: its grouping columns)
    slots: List[int]  # each running host's slot (its index in the host map)
    slots_names: List[Optional[str]]  # each slot's host (None: retired)
    buckets: int = 0  # (the drop-in: its rows are routed by bucket)
    stream_max_ms: Optional[List[Optional[int]]] = None

    def saw(self, tops) -> None:
        if not tops:
            return
        if self.stream_max_ms is None:
            self.stream_max_ms = list(tops)
            return
        self.stream_max_ms = [b if a is None else a if b is None else max(a, b)
                              for a, b in zip(self.stream_max_ms, tops)]


class FanOut:
    """Requests to the engines of every host (a mixin: the class provides ``engines``, ``hosts``,
    ``_spark`` and ``_one(i, msg, timeout)``, a request to host ``i``)."""

    _queries: Dict[str, _Query]

    # -- requests ----------------------------------------------------------------------------
    def call(self, msg: M.Request, timeout: Optional[float] = None):
        handler = getattr(self, f"_on_{msg.op}", None)
        if handler is not None:
            return handler(msg, timeout)
        return self._merge(msg, self._all(msg, timeout))

    def _all(self, msg: M.Request, timeout: Optional[float], hosts=None) -> list:
        """``msg`` to every host (or to ``hosts``) in parallel; the replies, in host order."""
        idx = range(len(self.engines)) if hosts is None else hosts
        return self._all_each([(i, msg) for i in idx], timeout)

    def _on_open(self, msg: M.Open, timeout: Optional[float]) -> M.Opened:
        spec = spec_from_wire(msg.spec)
        self._slot_names = None
        if not isinstance(spec, (AggregateSpec, GroupedSpec)):
            raise NotImplementedError(
                f"executors on hosts {self.hosts}: a {spec.kind} query runs on one host so far "
                "(the built-in aggregations and the applyInPandasWithState drop-in run on "
                "several)")
        if msg.query in self._queries:  # opened again (a restart): from its checkpoints only
            for i in range(len(self.engines)):
                try:
                    self._one(i, M.Close(query=msg.query), timeout)
                except Exception:
                    pass
        share, slots = self._share_of(msg.query, spec)
        replies = []
        for i, slot in enumerate(slots):
            state = None if spec.checkpoint.state_dir is None else \
                str(Path(spec.checkpoint.state_dir).parent / "hosts" / str(slot) / "state")
            mine = replace(spec, share=replace(share, host=slot),
                           checkpoint=replace(spec.checkpoint, state_dir=state))
            replies.append((i, M.Open(query=msg.query, spec=spec_to_wire(mine))))
        got = [r for r in self._all_each(replies, timeout)]
        grouped = isinstance(spec, GroupedSpec)
        q = self._queries[msg.query] = _Query(
            share, [list(r.replay) for r in got], "grouped" if grouped else spec.key_kind,
            spec.key_columns if grouped else spec.key_column, slots,
            self._slot_names or list(self.hosts), spec.buckets if grouped else 0)
        for r in got:
            q.saw(r.stream_max_ms)
        starts = [r.checkpoint for r in got]
        return replace(got[0], replay=sorted({b for r in got for b in r.replay}),
                       checkpoint=None if None in starts else min(starts),
                       instance_pids=[p for r in got for p in r.instance_pids])

    def _all_each(self, pairs, timeout: Optional[float]) -> list:
        """Each ``(host, message)`` to its host in parallel; the replies in order."""
        out, errors = [None] * len(pairs), []

        def one(k, i, m):
            try:
                out[k] = self._one(i, m, timeout)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(k, i, m), daemon=True)
                   for k, (i, m) in enumerate(pairs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise next((e for e in errors if isinstance(e, EngineDiedError)), errors[0])
        return out

    def _share_of(self, qid: str, spec):
        """The query's key groups and host map over its host *slots*, kept in its
        ``query.json`` (made the first time from ``spark.stretch.keyGroups``, a contiguous
        range of groups per host), and each running host's slot.

        A slot is a host's place in the query: its state directory ``hosts/<slot>/`` and its
        index in the host map. A host new to the query gets a new slot (with no groups); the
        groups of a slot whose host is gone (no executor there any more) go to the others, and
        the slot is retired (its directory stays a source of the state of those groups for
        the hosts that take them, ``host/reshard.py``; a host that comes back gets a new one).
        Returns ``(share, slot of each running host)``."""
        g = read_settings(self._spark.conf).key_groups
        if spec.checkpoint.state_dir is None or spec.warm_up:
            n = len(self.engines)
            return HostShare(host=0, hosts=n, key_groups=g,
                             host_map=balanced_host_map(g, n).tolist()), list(range(n))
        f = Path(spec.checkpoint.state_dir).parent / "query.json"
        meta = json.loads(f.read_text()) if f.exists() else {"format": 1}
        hosts = meta.get("hosts") or {"key_groups": g, "slots": list(self.hosts),
                                      "host_map": balanced_host_map(g, len(self.hosts)).tolist()}
        g, slots = int(hosts["key_groups"]), list(hosts["slots"])
        hm = validate_host_map(hosts["host_map"], g, len(slots)).tolist()
        slots += [h for h in self.hosts if h not in slots]
        gone = [j for j, h in enumerate(slots) if h is not None and h not in self.hosts]
        live = [slots.index(h) for h in self.hosts]
        if gone:  # (its groups to the running hosts, the least loaded first)
            for grp in (x for x in range(g) if hm[x] in gone):
                hm[grp] = min(live, key=lambda j: (hm.count(j), j))
            for j in gone:
                slots[j] = None
        if meta.get("hosts") != {**hosts, "slots": slots, "host_map": hm}:
            meta["hosts"] = {**hosts, "slots": slots, "host_map": hm}
            write_json(f, meta)
        self._slot_names = slots
        return HostShare(host=0, hosts=len(slots), key_groups=g, host_map=hm), live

    def set_host_map(self, qid: str, counts: Optional[Dict[str, int]],
                     state_dir: Optional[str], moves: Optional[Dict[int, str]] = None
                     ) -> HostShare:
        """Give each running host ``counts[host]`` key groups (moving as few as can be; a host
        new to the query gets a slot), or move the groups ``moves`` names to its host (``{group:
        host}``), kept in its ``query.json``: the share its next ``open`` runs with. Returns it."""
        q = self._queries[qid]
        slots = list(q.slots_names)
        slots += [h for h in self.hosts if h not in slots]
        unknown = sorted((set(counts or {}) | set((moves or {}).values())) - set(self.hosts))
        if unknown:
            raise ValueError(f"key_groups names hosts {unknown}; the query's hosts (with an "
                             f"executor) are {self.hosts}")
        if moves is not None:
            hm = list(q.share.host_map)
            for g, h in moves.items():
                if not 0 <= int(g) < len(hm):
                    raise ValueError(f"key group {g} moved: the query has {len(hm)} (0..."
                                     f"{len(hm) - 1})")
                hm[int(g)] = slots.index(h)
        else:
            by_slot = [int(counts.get(h, 0)) if h is not None else 0 for h in slots]
            hm = host_map_of_counts(by_slot, q.share.key_groups,
                                    before=q.share.host_map).tolist()
        q.share = replace(q.share, hosts=len(slots), host_map=hm)
        q.slots_names = slots
        if state_dir is not None:
            f = Path(state_dir).parent / "query.json"
            meta = json.loads(f.read_text())
            meta["hosts"] = dict(meta["hosts"], slots=slots, host_map=hm)
            write_json(f, meta)
        return q.share

    def host_map_of(self, qid: str) -> List[str]:
        """Each key group's host (by name)."""
        q = self._queries[qid]
        return [q.slots_names[s] for s in q.share.host_map]

    def groups_of(self, qid: str) -> Dict[str, int]:
        """How many key groups each running host owns (by host name)."""
        q = self._queries[qid]
        return {h: q.share.host_map.count(q.slots_names.index(h)) for h in self.hosts
                if h in q.slots_names}

    def _on_reconfigure(self, msg: M.Reconfigure, timeout: Optional[float]) -> M.Reconfigured:
        """Every host's instances switch; or, with ``msg.host``, that host's only."""
        if msg.host is None:
            return self._merge(msg, self._all(msg, timeout))
        if msg.host not in self.hosts:
            raise ValueError(f"reconfigure: host={msg.host!r} is not one of the query's hosts "
                             f"{self.hosts}")
        return self._one(self.hosts.index(msg.host), msg, timeout)

    def _on_step(self, msg: M.Step, timeout: Optional[float]) -> M.StepResult:
        q = self._queries[msg.query]
        hosts = [i for i, r in enumerate(q.replay) if msg.batch in r]
        got = self._all(msg, timeout, hosts=hosts or None)
        return self._steps(q, got, hosts or None)

    def _on_submit(self, msg: M.Submit, timeout: Optional[float]) -> M.Submitted:
        q = self._queries[msg.query]
        return self._all(replace(msg, stream_max_ms=q.stream_max_ms), timeout)[0]

    def _on_result(self, msg: M.Result, timeout: Optional[float]) -> M.StepResult:
        return self._steps(self._queries[msg.query], self._all(msg, timeout))

    def _steps(self, q: _Query, got: list, hosts=None) -> M.StepResult:
        """The hosts' step replies (of ``hosts``, indices; None: every host) as one; each
        host's figures (``elastic``) in a list, with its name and key groups."""
        hosts = list(range(len(got))) if hosts is None else hosts
        for r in got:
            q.saw(r.metrics.get("stream_max_ms"))
        m = dict(got[0].metrics)
        m["late_rows"] = sum(int(r.metrics.get("late_rows", 0)) for r in got)
        m["engine_ms"] = max(float(r.metrics.get("engine_ms", 0.0)) for r in got)
        m["stream_max_ms"] = q.stream_max_ms
        m["hosts"] = [{"rows": r.rows, **{k: r.metrics.get(k) for k in ("engine_ms",)}}
                      for r in got]
        if all("elastic" in r.metrics for r in got):
            hm = q.share.host_map
            m["elastic"] = {"key_groups": q.share.key_groups, "hosts": [
                dict(r.metrics["elastic"], host=self.engines[i].host,
                     key_groups=[g for g, s in enumerate(hm) if s == q.slots[i]])
                for i, r in zip(hosts, got)]}
        return M.StepResult(rows=sum(r.rows for r in got), stream=got[0].stream, metrics=m,
                            replayed=all(r.replayed for r in got))

    def _on_flush(self, msg: M.Flush, timeout: Optional[float]) -> M.FlushResult:
        q = self._queries[msg.query]
        got = self._all(replace(msg, stream_max_ms=q.stream_max_ms), timeout)
        return M.FlushResult(rows=sum(r.rows for r in got), batch=got[0].batch,
                             stream=next((r.stream for r in got if r.stream), None),
                             changed=any(r.changed for r in got), metrics=dict(got[0].metrics))

    def _on_write_delta(self, msg: M.WriteDelta, timeout: Optional[float]) -> M.DeltaWritten:
        prep = M.PrepareDelta(query=msg.query, stream=msg.stream, path=msg.path,
                              app_id=msg.app_id, version=msg.version)
        got = self._all(prep, timeout)
        bad = next((r for r in got if r.unsupported is not None), None)
        if bad is not None:
            return M.DeltaWritten(written=False, unsupported=bad.unsupported,
                                  permanent=bad.permanent)
        if all(r.done for r in got):
            return M.DeltaWritten(written=False, ms=max(r.ms or 0.0 for r in got))
        actions = [a for r in got for a in r.actions]
        return self._one(0, M.CommitDelta(query=msg.query, path=msg.path, app_id=msg.app_id,
                                          version=msg.version, actions=actions), timeout)

    def _on_create_delta(self, msg: M.CreateDelta, timeout: Optional[float]) -> M.DeltaCreated:
        return self._one(0, msg, timeout)

    def _on_ingest_files(self, msg: M.IngestFiles, timeout: Optional[float]) -> M.FilesIngested:
        got = self._all(msg, timeout)  # (every host reads every file, keeping its keys)
        return next((r for r in got if r.unsupported is not None), got[0])

    def _on_close(self, msg: M.Close, timeout: Optional[float]) -> M.Closed:
        got = self._all(msg, timeout)
        return M.Closed(max(r.open_queries for r in got))

    def _on_metrics(self, msg: M.Metrics, timeout: Optional[float]) -> M.Figures:
        got = [r.figures for r in self._all(msg, timeout)]
        share = self._queries[msg.query].share if msg.query in self._queries else None
        merged = dict(got[0])
        for k in ("input_rows", "late_rows", "output_rows", "live_windows", "state_keys",
                  "calls", "timeout_calls", "instance_retries", "state_disk_bytes",
                  "state_memory_bytes"):
            if k in merged:
                merged[k] = sum(int(f.get(k, 0)) for f in got)
        merged["hosts"] = [
            {"host": e.host, "pid": e.pid, "kernels": f.get("kernels"),
             "parallelism": f.get("parallelism"),
             "key_groups": None if share is None else share.host_map.count(
                 self._queries[msg.query].slots[i]),
             "input_rows": f.get("input_rows"), "live_windows": f.get("live_windows"),
             "state_keys": f.get("state_keys"),
             "bytes_in": f.get("bytes_in"), "refused": f.get("refused")}
            for i, (e, f) in enumerate(zip(self.engines, got))]
        return M.Figures(merged)

    def _merge(self, msg: M.Request, got: list):
        """The reply of a request every host answered alike (the first one's)."""
        if isinstance(msg, M.Reconfigure):
            return replace(got[0], switch_ms=max(r.switch_ms for r in got),
                           live_windows=sum(r.live_windows or 0 for r in got))
        return got[0]
