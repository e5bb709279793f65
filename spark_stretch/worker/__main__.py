"""``python -m spark_stretch.worker --fd FD --parent PID``: one instance process of the drop-in.

It serves the host engine on the socket ``FD`` (:mod:`spark_stretch.protocol.instances`) until
it is told to exit, its socket closes, or its parent (the engine) dies.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from multiprocessing.connection import Connection

from ..protocol import instances as I
from ..protocol.lifecycle import die_with_parent


def serve(fd: int, parent: int) -> int:
    """Answer the engine's requests on socket ``fd``; return the exit status."""
    die_with_parent()
    if os.getppid() != parent:
        return 0
    import faulthandler

    faulthandler.enable()
    conn = Connection(fd)
    inst = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0  # the engine is gone
        if isinstance(msg, I.Exit):
            return 0
        try:
            if isinstance(msg, I.Init):
                import pandas  # noqa: F401  (imported before the first batch, not during it)
                import pyspark.sql.conversion  # noqa: F401
                from pyspark.sql.streaming.state import GroupState  # noqa: F401

                from .instance import Instance

                if msg.spec.api == "applyInPandasWithState":
                    inst = Instance(msg)
                else:
                    from .processor import ProcessorInstance
                    inst = ProcessorInstance(msg)
                _tune_gc()
                reply = I.Ready(os.getpid())
            elif isinstance(msg, I.Batch) and inst is not None:
                reply = inst.batch(msg)
            else:
                raise TypeError(f"unexpected instance request {type(msg).__name__}")
        except BaseException:
            reply = I.Failed(traceback.format_exc())
            if inst is not None:  # a half-run batch: nothing of it was committed
                inst.reset()
        try:
            conn.send(reply)
        except (OSError, EOFError):
            return 0


def _tune_gc() -> None:
    """Fewer cyclic collections for a process that makes many small short-lived pandas objects
    per key: what the imports made is frozen (never scanned again), and the youngest
    generation is collected every 20,000 allocations, not every 700 (about 15% of a
    sessionization function's time went to collections that scanned the modules and the
    batch's own frames)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark_stretch.worker",
                                 description="an instance process of the stretch drop-in")
    ap.add_argument("--fd", type=int, required=True, help="the socket to the host engine")
    ap.add_argument("--parent", type=int, required=True, help="the host engine's pid")
    args = ap.parse_args(argv)
    return serve(args.fd, args.parent)


if __name__ == "__main__":
    sys.exit(main())
