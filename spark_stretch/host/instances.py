"""The host engine's end of the drop-in's instance processes (:mod:`spark_stretch.worker`).

Instances are processes (Python functions hold the GIL), all ``max_parallelism`` started with the
query, each with a socket pair to the engine. They die with the engine (``PR_SET_PDEATHSIG``)
and also exit when their socket closes. A death or an error is seen at once: the engine waits on
every instance of a step together and never blocks on one. An instance that dies during a step
is started again and runs its share of the step again, while the others go on (a failed task
costs Spark a retry of that task, not of the job), a bounded number of times.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait as conn_wait
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..protocol import instances as I
from ..protocol.errors import InstanceDiedError, StretchError, UserFunctionError
from ..protocol.lifecycle import spawn_child

__all__ = ["InstanceHandle", "InstancePool"]


class InstanceHandle:
    """One instance process: ``index`` in the query, its log file in ``shm``."""

    def __init__(self, index: int, shm: Path, again: bool = False):
        self.index = index
        self.starting = True  # until its Ready
        ours, theirs = socket.socketpair()
        self.log = shm / f"instance-{index}.log"
        env = dict(os.environ)
        env.pop("PYSPARK_GATEWAY_PORT", None)
        env["SPARK_STRETCH_PROCESS"] = "worker"  # (the package root attaches no driver API there)
        # a restarted instance appends: the output of the one that died stays in the log
        with open(self.log, "ab" if again else "wb") as log:
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

    def kill(self) -> None:
        """Make sure the process is gone (it closed its channel but may still run)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        try:
            self.conn.close()
        except OSError:
            pass

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
        self.shm, self.init = shm, init
        self.instances: List[InstanceHandle] = []
        self.cancelled: Optional[str] = None  # why the instances were killed (cancel)
        try:
            for i in range(n):
                self.instances.append(InstanceHandle(i, shm))
            for inst in self.instances:
                inst.send(self._init(inst.index))
            for inst in self.instances:
                inst.recv(timeout=300, what="start-up")
                inst.starting = False
        except BaseException:
            self.stop()
            raise

    def _init(self, index: int) -> I.Init:
        return I.Init(spec=self.init.spec, func=self.init.func, shm=self.init.shm, index=index,
                      state=self.init.state)

    def cancel(self, reason: str) -> None:
        """Kill every instance (from another thread than :meth:`run`'s): the step running fails
        at once with ``reason`` instead of starting them again; the pool is done."""
        self.cancelled = reason
        for inst in list(self.instances):
            if inst.proc.poll() is None:
                inst.proc.kill()

    @property
    def pids(self) -> List[int]:
        return [i.pid for i in self.instances]

    def restart(self, index: int) -> InstanceHandle:
        """A new process for instance ``index`` (the old one killed if it still runs). Its
        start-up is not waited for: its ``Ready`` comes before its first reply."""
        self.instances[index].kill()
        inst = self.instances[index] = InstanceHandle(index, self.shm, again=True)
        inst.send(self._init(index))
        return inst

    def run(self, msgs: Dict[int, I.Batch], what: str, max_deaths: int = 1,
            max_raises: int = 1) -> Tuple[Dict[int, I.BatchDone], list]:
        """Run one step: send each instance its message, wait for every reply (``what``: the
        step, for errors).

        An instance that dies is started again and sent its message again, up to
        ``max_deaths`` runs of its share; a function that raises is run again up to
        ``max_raises`` times in the same process (which dropped the half-run step). A share
        is applied to the state store in one transaction at its end, with a marker: a share
        whose process died before it runs again on the state the previous step left, one
        whose process died after it is answered from the marker (never applied twice). Past
        those bounds the step fails with a :class:`InstanceDiedError` or
        :class:`UserFunctionError` (never a hang); the shares that finished are applied, so
        the runtime is unusable after it and the query restarts from its checkpoint.

        Returns the replies and the retries made (``instance``, ``attempt``, ``cause``,
        ``died``, the new ``pid``, ``restart_ms``: to send it again, ``recovered_ms``: to
        its reply)."""
        deaths = dict.fromkeys(msgs, 0)
        raises = dict.fromkeys(msgs, 0)
        replies: Dict[int, I.BatchDone] = {}
        retries: list = []
        waiting: Dict[Connection, int] = {}
        to_send = list(msgs)

        def clean(i: int) -> None:  # what a failed run of instance i's share left
            I.output_file(self.shm, msgs[i].seq, i).unlink(missing_ok=True)
            I.changes_file(self.shm, msgs[i].seq, i).unlink(missing_ok=True)

        def failed(i: int, died: bool, cause: str) -> None:
            if self.cancelled:  # (killed on purpose: not started again)
                for j in msgs:
                    clean(j)
                raise InstanceDiedError(self.cancelled)
            t0 = time.perf_counter()
            n, most = (deaths, max_deaths) if died else (raises, max_raises)
            n[i] += 1
            runs = deaths[i] + raises[i]
            if n[i] >= most:
                for j in msgs:  # the step fails whole: the others' shares are not applied
                    clean(j)
                if died:
                    raise InstanceDiedError(
                        cause if most == 1 else f"{cause}\n(instance {i} died {n[i]} times "
                        f"running its share of {what}: spark.stretch.instanceMaxFailures={most})")
                raise UserFunctionError(cause)
            if died:  # (its files stay: a share it committed is answered with them)
                self.restart(i)
            else:
                clean(i)
            retries.append({"instance": i, "attempt": runs + 1, "cause": cause.split("\n")[0],
                            "died": died, "pid": self.instances[i].pid,
                            "restart_ms": (time.perf_counter() - t0) * 1e3, "t0": t0})
            to_send.append(i)

        while to_send or waiting:
            for i in to_send:
                inst = self.instances[i]
                try:
                    inst.send(msgs[i])
                    waiting[inst.conn] = i
                except InstanceDiedError:
                    waiting[inst.conn] = i  # (its death is taken below, as any other)
            to_send.clear()
            ready = conn_wait(list(waiting), timeout=5.0)
            dead = []
            for conn in ready:
                i = waiting.pop(conn)
                inst = self.instances[i]
                try:
                    r = conn.recv()
                except (EOFError, OSError):
                    dead.append(i)
                    continue
                if isinstance(r, I.Ready):  # a restarted instance is up: its reply comes next
                    inst.starting = False
                    waiting[conn] = i
                elif isinstance(r, I.Failed):
                    runs = deaths[i] + raises[i] + 1
                    if inst.starting:  # (it could not even load the function again)
                        failed(i, True, f"stretch instance {i} (pid {inst.pid}) failed to start "
                                        f"again during {what}:\n{r.error}")
                    else:
                        failed(i, False, f"applyInPandasWithState function failed in {what} "
                                         f"(stretch instance {i}, pid {inst.pid}"
                                         + (f", attempt {runs}" if runs > 1 else "")
                                         + f"):\n{r.error}")
                else:
                    replies[i] = r
                    for x in retries:  # the failure to the share's reply: its recovery
                        if x["instance"] == i and "t0" in x:
                            x["recovered_ms"] = (time.perf_counter() - x.pop("t0")) * 1e3
            for conn, i in list(waiting.items()):  # a killed instance may not close at once
                if self.instances[i].proc.poll() is not None:
                    del waiting[conn]
                    dead.append(i)
            for i in dead:
                runs = deaths[i] + raises[i] + 1
                failed(i, True, self.instances[i].death(
                    what if max_deaths == 1 else f"{what} (run {runs})"))
        return replies, retries

    def stop(self) -> None:
        for inst in self.instances:
            inst.stop()
        self.instances = []
