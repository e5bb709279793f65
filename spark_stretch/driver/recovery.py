"""Bringing the host engine's state to where Spark is: at start, after a restart, after a death.

Spark's answer to "what happens when something dies" is a replayable source, a checkpoint and an
idempotent sink; the engine's state is in the checkpoint too (``host/checkpoints.py``,
``host/input_log.py``). On start, the engine is opened to hold what it held after batch R,
Spark's last committed batch: from its latest checkpoint S <= R, it offers S's stored output
again and steps the logged inputs S+1..R again (``replay``), and each is written here with its
own batch id, so the sink takes each once. If the engine process dies, it is restarted that way
(``spark.stretch.onEngineFailure=restart``, at most ``spark.stretch.maxEngineRestarts`` times in
a row) or the query fails naming the cause.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from ..protocol import messages as M
from ..protocol.layout import QUERY_FORMAT, QueryLayout, check_format, shm_prefix, shm_root, \
    state_root, write_json
from ..protocol.specs import Checkpointing, QuerySpec, spec_to_wire
from .cluster import acquire_engine
from .engine import EngineDiedError
from .metrics import QueryMetrics
from .settings import QuerySettings
from .sink import QuerySink

__all__ = ["Recovery", "check_host", "checkpointing", "last_committed", "query_ids",
           "reconfiguration", "remove_shm"]


def last_committed(checkpoint) -> Optional[int]:
    """The last batch in the query's commit log (``<checkpoint>/commits/<N>``; a local path or
    a ``file:`` URI, as Spark resolves it), or None."""
    commits = QueryLayout(str(checkpoint)).root.parent / "commits"
    done = [int(p.name) for p in commits.iterdir() if p.name.isdigit()] if commits.is_dir() else []
    return max(done) if done else None


def checkpointing(layout: QueryLayout, settings: QuerySettings) -> Checkpointing:
    """Where and how the engine checkpoints the query: under its checkpoint, with the session's
    settings and Spark's own state store settings."""
    return Checkpointing(
        state_dir=str(layout.state_dir), interval=settings.checkpoint_interval,
        min_deltas=settings.min_deltas, min_batches_to_retain=settings.min_batches_to_retain,
        fsync=settings.fsync)


def reconfiguration(qid: str, parallelism: Optional[int], owner_map,
                    max_parallelism: int, host: Optional[str] = None) -> M.Reconfigure:
    """The request a user's ``reconfigure(parallelism=, owner_map=)`` makes (checked here:
    ``1 <= parallelism <= max_parallelism``, one of the two given); ``host``: on several
    hosts, the one whose instances switch (None: every host's)."""
    if parallelism is not None and not (1 <= parallelism <= max_parallelism):
        raise ValueError(f"parallelism={parallelism}: must be between 1 and "
                         f"max_parallelism={max_parallelism}")
    if parallelism is None and owner_map is None:
        raise ValueError("reconfigure() needs parallelism= or owner_map=")
    return M.Reconfigure(query=qid, parallelism=parallelism,
                         owner_map=None if owner_map is None else [int(x) for x in owner_map],
                         host=host)


def check_host(engine, host: Optional[str]) -> None:
    """A ValueError if ``host`` (of a reconfiguration) is given for a query on one host."""
    if host is not None and not engine.routed:
        raise ValueError(f"host={host!r}: the query runs on one host engine; host= names one "
                         "of the hosts of a query on several")


def query_ids(layout: QueryLayout) -> Tuple[str, str]:
    """The query's engine id and Delta app id, kept in its checkpoint (``query.json``), so a
    restart is the same query to the engine and to Delta."""
    f = layout.query_file
    f.parent.mkdir(parents=True, exist_ok=True)
    if f.exists():
        meta = json.loads(f.read_text())
        check_format(meta.get("format"), QUERY_FORMAT, f"the stretch query file {f}")
    else:
        meta = {"format": QUERY_FORMAT, "stretch_id": uuid.uuid4().hex,
                "app_id": f"stretch-{uuid.uuid4().hex}"}
        write_json(f, meta)
    return meta["stretch_id"], meta["app_id"]


def remove_shm(qid: str) -> None:
    """Remove what an engine that died left of the query on this host: the drop-in's steps'
    files in shared memory and its state store on local disk; a live engine removes its own
    when the query closes."""
    for root in {shm_root(), state_root()}:
        for d in Path(root).glob(f"{shm_prefix(qid)}*"):
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)


class Recovery:
    """One query's host engine, opened where Spark is, restarted when it dies.

    ``last_done`` is the last batch the engine holds (its state on disk, or for a pipelined
    query its input logged); the micro-batches advance it. ``layout`` and ``settings`` are the
    query's checkpoint paths and session settings.
    """

    def __init__(self, qid: str, spec: QuerySpec, layout: QueryLayout, settings: QuerySettings,
                 sink: QuerySink, kind, metrics: QueryMetrics, resume: Optional[int]):
        self.qid = qid
        self._spec = spec
        self.layout = layout
        self.settings = settings
        self._sink = sink
        self._kind = kind
        self._metrics = metrics
        self.last_done = resume
        self._aligned = False  # the resume point checked against Spark's (realign)
        self._reconfigs: List[dict] = []  # reconfigurations done, re-applied after a restart
        self._opening: Optional[threading.Thread] = None
        self._open_error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self.released = False
        self._figures: Optional[dict] = None  # the engine's last figures (also after the end)
        self._release_done = threading.Event()
        #: set by the pipeline: the batch in flight (or None), and how to forget it
        self.in_flight: Callable[[], Optional[int]] = lambda: None
        self.discard_in_flight: Callable[[], None] = lambda: None
        self.engine = acquire_engine(kind.session, settings)

    # -- opening -----------------------------------------------------------------------------
    def open_in_background(self) -> None:
        """Open the query on the engine while Spark starts its query (the engine process is
        still importing numba): the first batch, or anything else that needs it, waits
        (:meth:`opened`)."""
        def run():
            try:
                self._open(self.last_done)
            except BaseException as e:  # raised by opened(), on the thread that needs the engine
                self._open_error = e

        self._opening = threading.Thread(target=run, name="stretch-open", daemon=True)
        self._opening.start()

    def opened(self) -> None:
        """Wait until the query is open on the engine; raise (once) what opening it raised."""
        if self._opening is not None:
            self._opening.join()
        e, self._open_error = self._open_error, None
        if e is not None:
            raise e

    def join(self, timeout: Optional[float] = None) -> None:
        if self._opening is not None:
            self._opening.join(timeout)

    def _open(self, resume: Optional[int]) -> Optional[int]:
        """Open the query on the engine, continuing after batch ``resume``; step and write the
        batches it names to redo (``replay``) and a flush the sink has but the state has not.
        Returns the batch of the state the engine continued from (None: from the start)."""
        opened = self.engine.call(M.Open(query=self.qid, spec=spec_to_wire(
            replace(self._spec, resume_batch=resume))))
        for b in opened.replay:
            step = self.engine.call(M.Step(query=self.qid, batch=b))
            if step.rows:
                self._sink.emit(step.stream, step.rows, b)
        start = opened.checkpoint
        if resume is not None and self._sink.holds_flush(resume):
            # The last flush reached the table but not the saved state: replay it, unwritten.
            self.engine.call(M.Flush(query=self.qid))
            self.engine.call(M.Flushed(query=self.qid))
        return start

    def _reopen(self) -> Optional[int]:
        """Open the query on the (new or emptied) engine to hold what it held after batch
        ``last_done``, with the reconfigurations made since its checkpoint applied again (they
        are not in it). Returns the batch of the checkpoint it continued from."""
        start = self._open(self.last_done)
        hosts = getattr(self.engine, "hosts", ())
        for r in self._reconfigs:  # (a host's own: while it runs)
            if (start is None or r["after_batch"] >= start) and r["host"] in (None, *hosts):
                self.engine.call(M.Reconfigure(query=self.qid, parallelism=r["parallelism"],
                                               owner_map=r["owner_map"], persist=r["persist"],
                                               host=r["host"]))
        return start

    def realign(self, committed: Optional[int]) -> None:
        """Make the engine continue after ``committed``, the batch Spark's commit log ends at
        as the run's first batch (or its end) shows it, if that is not the batch it was opened
        after.

        The engine is opened while Spark starts the query, after the commit log read when the
        query started. A driver that died a moment ago may leave its JVM running long enough to
        commit one more batch after that read (its input is in the input log, or its state on
        disk): Spark then continues after it, and so must the engine, or that batch would be
        missing from the state. Called once, before anything is ingested.
        """
        if self._aligned:
            return
        self._aligned = True
        if committed == self.last_done:
            return
        if self.last_done is not None and (committed is None or committed < self.last_done):
            raise RuntimeError(
                f"Spark continues after batch {committed} but the commit log under "
                f"{self.layout.checkpoint} named batch {self.last_done} when the query "
                "started: was the checkpoint changed by another query meanwhile?")
        self.opened()
        self.engine.call(M.Close(query=self.qid))
        was, self.last_done = self.last_done, committed
        start = self._reopen()
        self._metrics.set("realigned", {"opened_after": was, "continued_after": committed,
                                        "checkpoint": start})

    def reconfigured(self, msg: M.Reconfigure, reply: M.Reconfigured, t0: float,
                     cause: str = "manual") -> dict:
        """Record a reconfiguration requested at ``t0`` (``perf_counter``) in the figures, with
        its ``cause`` (the user's ``"manual"``, or a policy's decision) and when it was done
        (``at_ms``, wall clock), and remember it, to apply it again after a restart; its
        record."""
        rec = dict(reply.to_dict(), cause=cause, request_ms=(time.perf_counter() - t0) * 1e3,
                   at_ms=int(time.time() * 1e3))
        if msg.host is not None:
            rec["host"] = msg.host
        self._metrics.append("reconfigurations", rec)
        self._reconfigs.append({"parallelism": msg.parallelism, "owner_map": msg.owner_map,
                                "after_batch": reply.after_batch, "persist": msg.persist,
                                "host": msg.host})
        return rec

    def move_groups(self, key_groups=None, moves: Optional[dict] = None,
                    cause: str = "manual") -> dict:
        """Move key groups between the query's hosts after the last batch: ``key_groups``, the
        number of groups each host owns next (a list in host order, or ``{host: count}``), or
        ``moves``, the groups to move and their host (``{group: host}``, a policy's). Every
        host checkpoints its state in full, the new host map goes into the query's checkpoint,
        and every host opens the query again with the state of its groups now, from all those
        checkpoints (``host/reshard.py``). Call between two batches, none ingested. Its record
        (also in ``metrics()["reconfigurations"]``): ``cause``, ``key_groups`` (each host's
        count), ``host_map`` (each group's host), ``moved_groups``, ``switch_ms``."""
        eng = self.engine
        if (key_groups is None) == (moves is None):
            raise ValueError("move_groups: give key_groups= or moves=")
        if not eng.routed:
            raise ValueError("key_groups=: the query runs on one host (its executors' host); "
                             "key groups move between the hosts of a query on several")
        if key_groups is not None and not isinstance(key_groups, dict):
            if len(key_groups) != len(eng.hosts):
                raise ValueError(f"key_groups={list(key_groups)}: the query runs on "
                                 f"{len(eng.hosts)} hosts ({', '.join(eng.hosts)}); give a "
                                 "count for each, or a {host: count} dict")
            key_groups = dict(zip(eng.hosts, key_groups))
        t0 = time.perf_counter()
        self.opened()
        before = list(eng.share_of(self.qid).host_map)
        if self.last_done is not None:  # every host's full state of the last batch
            eng.call(M.Flushed(query=self.qid))
        eng.add_hosts()  # (a host that has executors now gets an engine and can get groups)
        share = eng.set_host_map(self.qid, key_groups, self._spec.checkpoint.state_dir, moves)
        start = self._reopen()
        rec = {"cause": cause, "key_groups": eng.groups_of(self.qid),
               "host_map": eng.host_map_of(self.qid),
               "moved_groups": sum(a != b for a, b in zip(before, share.host_map[:len(before)])),
               "after_batch": self.last_done, "resumed_from": start,
               "switch_ms": (time.perf_counter() - t0) * 1e3, "at_ms": int(time.time() * 1e3)}
        self._metrics.append("reconfigurations", rec)
        return rec

    def figures(self) -> dict:
        """The engine's figures for the query: ``{"engine": ...}`` (the last ones, also after
        the end), with ``engine_error`` if a live engine could not say."""
        out = {}
        if self.released:  # (being released on another thread: its figures come last)
            self._release_done.wait(timeout=35)
        elif self.engine.alive():
            try:
                self.opened()
                self._figures = self.engine.call(M.Metrics(query=self.qid)).figures
            except Exception as e:  # metrics must not throw on a dying query
                out["engine_error"] = str(e)
        if self._figures is not None:
            out["engine"] = self._figures
        return out

    # -- engine death --------------------------------------------------------------------------
    def _engine_failed(self) -> bool:
        return self.engine.failed(1.0)

    def with_engine(self, what: str, fn, opened: bool = True):
        """Run ``fn``; if the host engine died meanwhile, restart it to hold what it held after
        the last batch done and run ``fn`` again (``onEngineFailure=restart``, at most
        ``maxEngineRestarts`` times in a row), or fail naming the cause. ``opened=False``:
        ``fn`` waits for the query's open itself (a micro-batch ingests meanwhile)."""
        attempt = 0
        while True:
            try:
                if opened:
                    self.opened()
                return fn()
            except Exception as e:
                if not self._engine_failed():
                    raise
                attempt += 1
                self._restart(e, what, attempt)

    def _restart(self, e: Exception, what: str, attempt: int) -> None:
        dead = self.engine
        if getattr(e, "stretch_batch", None) is not None:  # the batch in flight died
            what = f"batch {e.stretch_batch}"
        elif self.in_flight() is not None:  # maybe while stepping that one
            what += f" (batch {self.in_flight()} in flight)"
        cause = dead.death(f"during {what}")
        remove_shm(self.qid)  # what its instances left in /dev/shm
        policy = self.settings.on_failure
        if policy == "fail" or attempt > self.settings.max_restarts:
            hint = ("; set spark.stretch.onEngineFailure=restart to restart it from the "
                    "checkpoint" if policy == "fail" else
                    f" after {attempt - 1} restarts (spark.stretch.maxEngineRestarts)")
            raise EngineDiedError(cause + hint) from e
        t0 = time.perf_counter()
        self.discard_in_flight()  # its batch is redone from the input log
        fresh = dead.restarted()
        with self._lock:  # the query may have ended meanwhile: then nobody would release it
            if self.released:
                fresh.release()
                raise EngineDiedError(cause + "; the query ended before the restart") from e
            self.engine = fresh
        start = self._reopen()
        self._metrics.append("engine_restarts", {"cause": cause, "resumed_from": start,
                                                 "restart_s": time.perf_counter() - t0})

    # -- the end ---------------------------------------------------------------------------------
    def release(self) -> Optional[dict]:
        """Close the query on the engine and drop the engine (stopped with its last query);
        the engine's last figures, if it was alive."""
        with self._lock:
            if self.released:
                return None
            self.released = True
        figures = None
        try:
            if self.engine.alive():
                figures = self.engine.call(M.Metrics(query=self.qid), timeout=30).figures
                self._figures = figures
                self.engine.call(M.Close(query=self.qid), timeout=30)
        except Exception:
            pass
        finally:
            self._release_done.set()
        self.engine.release()
        remove_shm(self.qid)
        return figures
