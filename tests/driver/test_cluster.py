"""The shim with two executor JVMs on one host (local-cluster[2,1,1024]), in a subprocess."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from spark_stretch.testing import run_script

pytestmark = pytest.mark.cluster


def _java_pids() -> set:
    out = subprocess.run(["pgrep", "-f", "java"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.soak  # (a local-cluster of two executors: a minute; make test-soak)
def test_two_executor_jvms_share_one_receiver():
    before = _java_pids()
    result = run_script(Path(__file__).with_name("cluster_job.py"))
    assert result["executors"] == 2
    # Both executor JVMs wrote their partitions to the one host receiver, none is the driver.
    assert len(result["writer_pids"]) == 2
    # stretchAggregate equalled native Spark, with both executor JVMs writing to one host engine.
    assert len(result["engine_writer_pids"]) == 2
    # So did a band join of two streams (others=), equal to Spark's stream-stream join.
    assert len(result["join_writer_pids"]) == 2
    # The driver, master, worker and executor JVMs of the job all end with it.
    deadline = time.time() + 60
    while _java_pids() - before and time.time() < deadline:
        time.sleep(1)
    assert not _java_pids() - before, "JVMs outlived the local-cluster job"
