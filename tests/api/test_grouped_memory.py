"""The drop-in's state larger than the memory its processes may use.

The engine and its instance processes run in a memory cgroup (an executor container's limit, as
YARN or Kubernetes give one) far smaller than the state they build: 32 KB per key, more than
twice the limit over the run, with keys of the first batch touched again in every later batch
(their state read back from disk). What a batch changes must fit in memory (an instance holds
its step's writes until it commits them); the state need not. Oracle: native ``applyInPandasWithState`` (RocksDB) on the
same file stream, one file per micro-batch, both into Delta. Needs a writable cgroup v1 memory
controller (root); skipped otherwise, saying so.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from pyspark.sql.streaming.state import GroupStateTimeout

from spark_stretch.testing import publish

from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.soak  # (a few minutes: 1.6 GB of state on each side; make test-soak)

CGROUPS = Path("/sys/fs/cgroup/memory")
BLOB = 32 * 1024
FILES, NEW, OLD = 24, 2000, 500  # per file: new users, and users of the first file again


def blob(key, pdfs, state):
    """A count per user, with 32 KB of state per user (made from the user's name)."""
    n = state.get[0] if state.exists else 0
    if state.exists:
        assert state.get[1] == (key[0] * BLOB)[:BLOB]  # (read back intact)
    for pdf in pdfs:
        n += len(pdf)
    state.update((n, (key[0] * BLOB)[:BLOB]))
    yield pd.DataFrame({"user": [key[0]], "n": [n]})


ARGS = (blob, "user string, n long", "n long, blob string", "Append",
        GroupStateTimeout.NoTimeout)


def _files(folder: Path):
    folder.mkdir()
    out = []
    for f in range(FILES):
        users = [f"u{f}-{i}" for i in range(NEW)] + ([f"u0-{i}" for i in range(OLD)] if f else [])
        t = pa.table({"user": users, "ts": pa.array([f * 1_000_000] * len(users),
                                                    pa.timestamp("us"))})
        path = folder.parent / f"part-{f:03d}.parquet"
        pq.write_table(t, path)
        out.append(path)
    return out


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class _Cgroup:
    """A memory cgroup (v1) for the test's engine processes, removed at the end."""

    def __init__(self):
        if not os.access(CGROUPS / "cgroup.procs", os.W_OK):
            pytest.skip(f"needs a writable cgroup v1 memory controller at {CGROUPS} (root)")
        self.dir = CGROUPS / f"stretch-test-{os.getpid()}"
        self.dir.mkdir(exist_ok=True)
        self.pids = []

    def limit(self, nbytes: int) -> None:
        (self.dir / "memory.limit_in_bytes").write_text(str(nbytes))

    def add(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))
        self.pids.append(pid)

    def read(self, name: str) -> str:
        return (self.dir / name).read_text()

    def remove(self) -> None:
        for pid in self.pids:  # (the session's engine outlives the test)
            try:
                (CGROUPS / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # (gone)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def test_state_twice_the_engines_memory_limit_completes_equal_to_native(spark, tmp_path):
    src = tmp_path / "src"
    files = _files(src)

    def query(stretch: bool):
        df = (spark.readStream.schema("user string, ts timestamp")
              .option("maxFilesPerTrigger", 1).parquet(str(src)))
        gd = df.groupBy("user")
        return (gd.stretchApplyInPandasWithState(*ARGS, parallelism=2) if stretch
                else gd.applyInPandasWithState(*ARGS))

    cg = _Cgroup()
    try:
        publish(files[0], src)
        q = (query(True).writeStream.format("delta").option(
            "checkpointLocation", str(tmp_path / "c")).trigger(processingTime="1 second")
            .start(str(tmp_path / "out")))
        q.processAllAvailable()
        engine = q.metrics()["engine"]
        pids = [engine["pid"], *engine["instance_pids"]]
        anon = sum(_rss_anon(p) for p in pids)
        limit = anon + (300 << 20)  # (their own memory now, and 300 MB for the state's pages)
        cg.limit(limit)
        for p in pids:
            cg.add(p)
        for f in files[1:]:
            publish(f, src)
            q.processAllAvailable()
        engine = q.metrics()["engine"]
        disk, rows = engine["state_disk_bytes"], engine["state_keys"]
        q.stop()
        failcnt = int(cg.read("memory.failcnt"))
        oom = cg.read("memory.oom_control")
    finally:
        cg.remove()
    print(f"state {disk / 2**20:.0f} MB on disk, {rows} keys; limit {limit / 2**20:.0f} MB "
          f"(processes {anon / 2**20:.0f} MB at the start); limit reached {failcnt} times")
    assert rows == FILES * NEW
    assert disk > 2 * limit, (disk, limit)  # the state: twice what the processes may use
    assert failcnt > 0  # (the limit was reached: the kernel reclaimed the store's pages)
    assert "oom_kill 0" in oom or "oom_kill" not in oom, oom
    nq = (query(False).writeStream.format("delta").option(
        "checkpointLocation", str(tmp_path / "nc")).trigger(availableNow=True)
        .start(str(tmp_path / "native")))
    nq.awaitTermination()
    got = spark.read.format("delta").load(str(tmp_path / "out"))
    want = spark.read.format("delta").load(str(tmp_path / "native"))
    assert want.count() == FILES * NEW + (FILES - 1) * OLD
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True,
                       ignore_metadata=True)
