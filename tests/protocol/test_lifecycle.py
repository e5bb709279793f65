"""``spawn_child``: children die with their parent, and starting them leaves the driver's py4j
connections alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from spark_stretch.protocol.lifecycle import spawn_child


def test_a_child_dies_with_its_parent_killed_by_sigkill(tmp_path):
    # parent: spawns a sleeping child, prints its pid, then sleeps; killed with -9
    script = ("import sys, time\n"
              "from spark_stretch.protocol.lifecycle import spawn_child\n"
              "c = spawn_child([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(c.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, 9)
    pytest.fail("the child outlived its parent")


def test_a_child_started_from_a_thread_keeps_the_drivers_active_session(spark):
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is not None
    done = []
    t = threading.Thread(target=lambda: done.append(spawn_child(["true"]).wait()))
    t.start()
    t.join()
    assert done == [0]
    # (a preexec_fn child forked from a thread finalized the main thread's py4j connection)
    assert SparkSession.getActiveSession() is not None
