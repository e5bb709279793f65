"""How one stretch process starts another: the child dies with its parent, even by kill -9.

The driver starts the host engine, and the host engine the drop-in's instance processes, through
:func:`spawn_child`; an instance that starts itself calls :func:`die_with_parent`.

Examples
--------
>>> import sys
>>> from spark_stretch.protocol.lifecycle import spawn_child
>>> spawn_child([sys.executable, "-c", "pass"]).wait()
0
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

__all__ = ["die_with_parent", "spawn_child"]


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (``PR_SET_PDEATHSIG``)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# Linux delivers PR_SET_PDEATHSIG when the *thread* that forked the child exits, not the process:
# a child started from a short-lived thread (a py4j callback, a request handler) would be killed
# with it. So children are started from one thread that lives as long as this process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stretch-spawner")

# The child sets PR_SET_PDEATHSIG itself, in a small launcher that then execs the command (the
# setting survives exec), and exits if its parent is already gone. Not a ``preexec_fn``: that
# runs Python's after-fork handlers in the child, and forked from a thread other than the main
# one they finalize the main thread's py4j connection, whose socket the child shares: the
# driver's main thread then loses its JVM thread (and Spark's active session with it).
_LAUNCH = ("import ctypes, os, signal, sys\n"
           "try:\n"
           "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
           "except OSError:\n"
           "    pass\n"
           "if os.getppid() != int(sys.argv[1]):\n"
           "    sys.exit(1)\n"
           "os.execvp(sys.argv[2], sys.argv[2:])\n")


def spawn_child(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` of a child that dies with this process (``args`` a
    list: the program and its arguments)."""
    launch = [sys.executable, "-I", "-S", "-c", _LAUNCH, str(os.getpid()), *map(str, args)]
    return _SPAWNER.submit(subprocess.Popen, launch, **kwargs).result()
