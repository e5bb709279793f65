"""The host engine's end of the drop-in's instance processes (:mod:`spark_stretch.worker`).

Instances are processes (Python functions hold the GIL), all ``max_parallelism`` started with the
query, each with a socket pair to the engine. They die with the engine (``PR_SET_PDEATHSIG``)
and also exit when their socket closes. A death or an error is seen at once: the engine waits on
every instance of a step together and never blocks on one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait as conn_wait
from pathlib import Path
from typing import Dict, List

from ..protocol import instances as I
from ..protocol.errors import InstanceDiedError, StretchError, UserFunctionError
from ..protocol.lifecycle import spawn_child

__all__ = ["InstanceHandle", "InstancePool"]


class InstanceHandle:
    """One instance process: ``index`` in the query, its log file in ``shm``."""

    def __init__(self, index: int, shm: Path):
        self.index = index
        ours, theirs = socket.socketpair()
        self.log = shm / f"instance-{index}.log"
        env = dict(os.environ)
        env.pop("PYSPARK_GATEWAY_PORT", None)
        env["SPARK_STRETCH_PROCESS"] = "worker"  # (the package root attaches no driver API there)
        with open(self.log, "wb") as log:
            self.proc = spawn_child(
                [sys.executable, "-m", "spark_stretch.worker", "--fd", str(theirs.fileno()),
                 "--parent", str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError):
            raise InstanceDiedError(self.death("a request")) from None

    def recv(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise InstanceDiedError(self.death(what))
        try:
            r = self.conn.recv()
        except (EOFError, OSError):
            raise InstanceDiedError(self.death(what)) from None
        if isinstance(r, I.Failed):
            raise StretchError(f"stretch instance {self.index} failed during {what}:\n{r.error}")
        return r

    def death(self, what: str) -> str:
        """What happened to this instance, with the tail of its output."""
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        code = self.proc.returncode
        how = "is still running but closed its channel" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        tail = ""
        try:
            tail = self.log.read_text(errors="replace")[-3000:].strip()
        except OSError:
            pass
        return (f"stretch instance {self.index} (pid {self.pid}) {how} during {what}"
                + (f"; its output:\n{tail}" if tail else ""))

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.conn.send(I.Exit())
                except (OSError, EOFError):
                    pass
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            try:
                self.conn.close()
            except OSError:
                pass


class InstancePool:
    """The ``n`` instance processes of one query, started with :class:`~.protocol.instances.Init`."""

    def __init__(self, n: int, shm: Path, init: I.Init):
        self.instances: List[InstanceHandle] = []
        try:
            for i in range(n):
                self.instances.append(InstanceHandle(i, shm))
            for inst in self.instances:
                inst.send(I.Init(spec=init.spec, func=init.func, shm=init.shm, index=inst.index))
            for inst in self.instances:
                inst.recv(timeout=300, what="start-up")
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> List[int]:
        return [i.pid for i in self.instances]

    def run(self, msgs: Dict[int, I.Batch], batch: int) -> Dict[int, I.BatchDone]:
        """Send each instance its message and wait for every reply. An instance that dies or
        whose function raises fails the step with a :class:`InstanceDiedError` or
        :class:`UserFunctionError` (never a hang)."""
        for i, msg in msgs.items():
            self.instances[i].send(msg)
        waiting = {self.instances[i].conn: i for i in msgs}
        replies = {}
        while waiting:
            ready = conn_wait(list(waiting), timeout=5.0)
            for conn in ready:
                i = waiting.pop(conn)
                inst = self.instances[i]
                try:
                    r = inst.conn.recv()
                except (EOFError, OSError):
                    raise InstanceDiedError(inst.death(f"batch {batch}")) from None
                if isinstance(r, I.Failed):
                    raise UserFunctionError(
                        f"applyInPandasWithState function failed in batch {batch} (stretch "
                        f"instance {i}, pid {inst.pid}):\n{r.error}")
                replies[i] = r
            for conn, i in list(waiting.items()):  # a killed instance may not close at once
                if self.instances[i].proc.poll() is not None:
                    raise InstanceDiedError(self.instances[i].death(f"batch {batch}"))
        return replies

    def stop(self) -> None:
        for inst in self.instances:
            inst.stop()
        self.instances = []
