"""Killing a driver as a crash of its machine would, for recovery tests.

Examples
--------
>>> import subprocess, sys
>>> p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
...                      stdout=subprocess.PIPE, text=True)
>>> kill_driver(p)
>>> running(p.pid)
False
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

__all__ = ["driver_env", "end_process_groups", "kill_driver", "kill_driver_once_logged",
           "running"]


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has exited: it only waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def driver_env(tmp: Path, **extra) -> dict:
    """The environment for a Spark driver started as a process to be killed: this one's, with
    Spark's temporary files under ``tmp``.

    A JVM killed with -9 deletes nothing on its way out, and Spark puts its scratch in two
    places: its local directories (``SPARK_LOCAL_DIRS``: shuffle and block files) and the JVM's
    ``java.io.tmpdir`` (its ``spark-*`` and ``artifacts-*`` directories, the native libraries
    lz4 and snappy unpack). Both are set under ``tmp`` (a test's ``tmp_path``, which pytest
    removes), so a killed driver leaves nothing in the machine's /tmp. ``extra``: more
    variables, e.g. ``SPARK_LOCAL_IP``.

    Examples
    --------
    >>> import tempfile
    >>> d = tempfile.TemporaryDirectory()
    >>> env = driver_env(Path(d.name), SPARK_LOCAL_IP="127.0.0.1")
    >>> "-Djava.io.tmpdir=" in env["SPARK_SUBMIT_OPTS"], Path(env["SPARK_LOCAL_DIRS"]).name
    (True, 'spark-local')
    >>> d.cleanup()
    """
    java_tmp = Path(tmp) / "java-tmp"
    java_tmp.mkdir(parents=True, exist_ok=True)
    # (SPARK_SUBMIT_OPTS: the options spark-submit's launcher gives the driver JVM it starts,
    # which pyspark's gateway is; any options already set are kept)
    opts = f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} -Djava.io.tmpdir={java_tmp}".strip()
    return {**os.environ, "SPARK_LOCAL_DIRS": str(Path(tmp) / "spark-local"),
            "SPARK_SUBMIT_OPTS": opts, **extra}


def kill_driver(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """kill -9 a driver started as ``proc`` (its output piped): its Python process and the
    Spark JVM it launched, as a crash of its machine would (a JVM outliving its Python for a
    moment could still commit a batch and plan the next one, beside a restarted query). Its
    engine is left to notice that its parent died."""
    jvms = subprocess.run(["pgrep", "-P", str(proc.pid), "java"], capture_output=True,
                          text=True).stdout.split()
    for pid in jvms:
        os.kill(int(pid), signal.SIGKILL)
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    deadline = time.time() + timeout
    while any(running(int(pid)) for pid in jvms):
        if time.time() > deadline:
            raise TimeoutError(f"the driver's JVM {jvms} still runs {timeout:.0f} s after kill -9")
        time.sleep(0.1)


def kill_driver_once_logged(proc: subprocess.Popen, logged: Path, timeout: float = 300.0) -> None:
    """Wait until a driver started as ``proc`` (its output piped) has written ``logged`` (e.g.
    the engine's input log of a batch, ``<checkpoint>/stretch/input/2.arrow``, or ``2.files``
    for a batch the engine read from its files), then :func:`kill_driver` it: a crash mid-run.
    Fails with the driver's output if it exits first, or after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while not Path(logged).exists():
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) before {logged}:\n"
                                 + proc.stdout.read()[-3000:])
        if time.time() > deadline:
            kill_driver(proc)
            raise AssertionError(f"the driver never wrote {logged} in {timeout:.0f} s")
        time.sleep(0.02)
    kill_driver(proc)


def end_process_groups(procs: Sequence[subprocess.Popen], term_wait: float = 15.0,
                       kill_wait: float = 10.0) -> None:
    """End ``procs``, each started in a session of its own (``start_new_session=True``), with
    whatever they started: SIGTERM to each process group (in reverse order: the last started
    first), a wait of up to ``term_wait`` seconds, then SIGKILL to what remains and a wait of
    up to ``kill_wait``."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        for p in reversed(procs):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
