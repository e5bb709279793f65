"""A benchmark's working directory, gone however the run ends.

Every benchmark writes its events, tables and checkpoints under one temporary directory
(gigabytes at 20M keys). :func:`bench_run` makes it and, when the run ends (normally, by an
exception, Ctrl-C, or one SIGTERM), stops the running queries of every Spark session it was
given and those sessions, then removes the directory. A second SIGTERM, as ``timeout``
forwards one, is ignored so that it cannot cut the clean-up short. A SIGTERM to the whole
process group ends Spark's JVM too: stopping then fails at once and the directory is still
removed. Under SIGKILL nothing can clean up.

Examples
--------
>>> import spark_stretch
>>> with bench_run("stretch-bench-example-") as run:           # doctest: +SKIP
...     spark = run.session(spark_stretch.session())
...     (run.path / "events").mkdir()
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator, List

__all__ = ["BenchRun", "bench_run"]


class BenchRun:
    """The working directory (:attr:`path`) and the Spark sessions to stop before removing it."""

    def __init__(self, path: Path):
        self.path = path
        self._sessions: List = []

    def session(self, spark):
        """Register ``spark`` (stopped, with its running queries, when the run ends); returns it."""
        self._sessions.append(spark)
        return spark

    def stop_sessions(self, timeout: float = 120.0) -> None:
        """Stop each registered session's running queries (they would write on into the
        directory), then the session; from a thread of its own, for at most ``timeout``
        seconds. Best effort: a run cut short may leave either half stopped."""
        # (a SIGTERM may have cut the main thread's py4j call short, awaitTermination say:
        # that thread's connection waits for the call's answer, a new thread has its own)
        sessions, self._sessions = self._sessions, []
        stopping = threading.Thread(target=_stop, args=(sessions,), name="bench-stop",
                                    daemon=True)
        stopping.start()
        stopping.join(timeout)


@contextlib.contextmanager
def bench_run(prefix: str) -> Iterator[BenchRun]:
    """A :class:`BenchRun` in a new temporary directory named ``prefix...``; on exit its
    sessions are stopped and the directory removed (see the module docstring)."""
    def on_term(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    previous = signal.signal(signal.SIGTERM, on_term)
    run = BenchRun(Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield run
    finally:
        run.stop_sessions()
        shutil.rmtree(run.path, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _stop(sessions) -> None:
    for spark in sessions:
        for stop in [q.stop for q in _active(spark)] + [spark.stop]:
            try:
                stop()
            except Exception:
                pass


def _active(spark) -> list:
    try:
        return spark.streams.active
    except Exception:
        return []
