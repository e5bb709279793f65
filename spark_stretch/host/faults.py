"""Fault injection points of the host engine process, for the recovery tests (inactive unless
``SPARK_STRETCH_TEST_FAULT`` is set).

``SPARK_STRETCH_TEST_FAULT`` holds comma-separated ``action@point:batch:marker`` entries, read by the
host engine process (a test sets it in the driver's environment, which the engine inherits). At ``point`` of micro-batch ``batch`` (``*``: any), ``action`` happens once:
the first process to create the file ``marker`` fires it, later ones (a restarted engine) do not.
A test arms a fault later by creating ``marker`` first and removing it when the time comes.

- actions: ``kill`` (the engine process SIGKILLs itself), ``fail`` (the request fails, so the
  Spark task doing it fails and Spark retries it) or ``stall`` (it waits 60 s, so a test can
  kill something while the engine is at that point).
- points: ``files`` (the engine reading the batch's Parquet files), ``write`` (an executor's
  ingest write of the batch), ``commit`` (the ingest commit),
  ``logged`` (the batch's input just written to the input log), ``step`` (inside the engine
  step, after the input was added, before windows are emitted), ``read`` (an executor reading
  the batch's output), ``direct`` (the engine's own Delta append), ``checkpoint`` (the batch's
  checkpoint written, not yet renamed into place), ``saved`` (before the driver's wait
  for the batch's checkpoint returns), ``reconfigure``.
"""

from __future__ import annotations

import os
import signal
import time

from ..protocol.errors import InjectedFault

__all__ = ["ENV", "batch_of", "inject"]

ENV = "SPARK_STRETCH_TEST_FAULT"


def batch_of(stream: str) -> int:
    """The micro-batch of a ``<query>:<kind>:<batch>`` stream name (-1 if it has none)."""
    tail = stream.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def inject(point: str, batch: int) -> None:
    """Fire the fault armed for ``point`` of ``batch``, if any (see the module doc)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        action, _, rest = item.partition("@")
        p, b, marker = rest.split(":", 2)
        if p != point or (b != "*" and int(b) != batch):
            continue
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "stall":
            time.sleep(60)
            return
        raise InjectedFault(f"injected fault at {point} of batch {batch}")
