"""An instance process of the drop-in, driven as the host engine drives it (no Spark session).

Oracle: a sequential run of the same function over the same keys in plain Python.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql.types import LongType, StringType, StructField, StructType

from spark_stretch.host.instances import InstancePool
from spark_stretch.protocol import instances as I
from spark_stretch.protocol.errors import InstanceDiedError, UserFunctionError
from spark_stretch.protocol.layout import bucket_file
from spark_stretch.protocol.specs import GroupedSpec

OUT = StructType([StructField("k", StringType()), StructField("n", LongType())])
STATE = StructType([StructField("n", LongType())])


def running_count(key, pdfs, state):
    import pandas as pd

    n = state.get[0] if state.exists else 0
    for pdf in pdfs:
        if (pdf["x"] < 0).any():
            raise ValueError("negative x")
        n += len(pdf)
    state.update((n,))
    yield pd.DataFrame({"k": [key[0]], "n": [n]})


def _pool(func):
    shm = Path(tempfile.mkdtemp(prefix="stretch-test-worker-", dir="/dev/shm"))
    spec = GroupedSpec(key_columns=["k"], columns=["k", "x"], out_schema=OUT.json(),
                       state_schema=STATE.json(), output_mode="Update",
                       timeout_conf="NoTimeout", buckets=4, max_parallelism=1,
                       runner_conf={"timezone": "UTC"})
    return InstancePool(1, shm, I.Init(spec=spec, func=cloudpickle.dumps(func), shm=str(shm),
                                       index=0)), shm


def _gone(p, shm):
    p.stop()
    shutil.rmtree(shm)


@pytest.fixture
def pool():
    p, shm = _pool(running_count)
    yield p, shm
    _gone(p, shm)


def _bucket(k: str) -> int:
    # Not hash(): Python salts str hashes per process, and the tests need the same buckets each run.
    return sum(map(ord, k)) % 4


def _batch(shm, seq, rows):
    """One batch of ``rows`` (key, x), all keys in bucket ``_bucket(k)``, sorted by (bucket, key)."""
    rows = sorted(rows, key=lambda r: (_bucket(r[0]), r[0]))
    t = pa.table({"k": [r[0] for r in rows], "x": [r[1] for r in rows]})
    starts = [i for i in range(len(rows)) if i == 0 or rows[i][0] != rows[i - 1][0]]
    path = I.input_file(shm, seq, 0)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t)
    return I.Batch(batch=seq, seq=seq, owned=np.arange(4), reload=np.arange(0),
                   batch_ts_ms=0, watermark_ms=0, input=str(path),
                   starts=np.asarray(starts, np.int64),
                   group_buckets=np.asarray([_bucket(rows[i][0]) for i in starts], np.int64))


def _rows(done: I.BatchDone):
    with pa.memory_map(done.out) as src:
        return sorted(pa.ipc.open_file(src).read_all().to_pylist(), key=lambda r: r["k"])


def test_keys_are_called_in_order_and_their_state_kept_in_bucket_files(pool):
    p, shm = pool
    batches = [[("a", 1), ("b", 2), ("a", 3)], [("b", 1), ("c", 5)], [("a", 0)]]
    counts = {}
    for seq, rows in enumerate(batches, 1):
        done = p.run({0: _batch(shm, seq, rows)}, f"batch {seq}")[0][0]
        for k, _ in rows:  # the sequential oracle
            counts[k] = counts.get(k, 0) + 1
        want = sorted({k: counts[k] for k, _ in rows}.items())
        assert [(r["k"], r["n"]) for r in _rows(done)] == want
        assert done.calls == len({k for k, _ in rows})
    # every key's state is in its bucket's file, as Spark's internal row
    stored = {}
    for b in range(4):
        if bucket_file(shm, b).exists():
            stored.update(pickle.loads(bucket_file(shm, b).read_bytes()))
    assert {k[0]: v[0][0] for k, v in stored.items()} == counts


def test_a_failing_function_fails_the_batch_with_its_traceback(pool):
    p, shm = pool
    with pytest.raises(UserFunctionError, match=r"(?s)failed in batch 1 .*ValueError: negative x"):
        p.run({0: _batch(shm, 1, [("a", -1)])}, "batch 1")


def test_a_killed_instance_is_reported_not_waited_for(pool):
    p, shm = pool
    os.kill(p.pids[0], signal.SIGKILL)
    with pytest.raises(InstanceDiedError, match=r"stretch instance 0 \(pid \d+\) was killed by "
                                                r"signal 9 during batch 1"):
        p.run({0: _batch(shm, 1, [("a", 1)])}, "batch 1")


def _stored(shm):
    stored = {}
    for b in range(4):
        if bucket_file(shm, b).exists():
            stored.update(pickle.loads(bucket_file(shm, b).read_bytes()))
    return {k[0]: v[0][0] for k, v in stored.items()}


def _leftovers(shm):
    """What a step may not leave in the shared-memory directory."""
    return sorted(f.name for f in shm.iterdir()
                  if not (f.name.startswith("b") or f.name.endswith(".log")))


def dies_in_write_back(marker):
    """A running count whose instance, once (``marker``), dies while it writes back the
    buckets it changed: after the first bucket file, in the middle of the second."""
    def count(key, pdfs, state):
        import pandas as pd

        if not os.path.exists(marker):
            open(marker, "w").close()
            import spark_stretch.worker.instance as instance

            dumps, calls = instance.pickle.dumps, []

            class Dying:  # the module's pickle, as write-back uses it
                def dumps(self, obj, **kw):
                    calls.append(1)
                    if len(calls) == 2:
                        os._exit(9)
                    return dumps(obj, **kw)

            instance.pickle = Dying()
        n = state.get[0] if state.exists else 0
        n += sum(len(pdf) for pdf in pdfs)
        state.update((n,))
        yield pd.DataFrame({"k": [key[0]], "n": [n]})
    return count


def test_an_instance_dying_mid_write_back_runs_its_share_again_on_the_old_state(tmp_path):
    # Batch 2's run dies after writing one of its changed buckets and in the middle of another:
    # a new process runs the share again on batch 1's state, and every count is counted once.
    p, shm = _pool(dies_in_write_back(str(tmp_path / "died")))
    try:
        keys = ["a", "b", "c", "d", "e", "f"]
        assert len({_bucket(k) for k in keys}) == 4  # several buckets change in each batch
        open(tmp_path / "died", "w").close()  # batch 1 runs as is
        done = p.run({0: _batch(shm, 1, [(k, 1) for k in keys])}, "batch 1", max_deaths=4)
        os.unlink(done[0][0].out)
        os.unlink(tmp_path / "died")
        pid = p.pids[0]
        replies, retries = p.run({0: _batch(shm, 2, [(k, 1) for k in keys] + [("a", 2)])},
                                 "batch 2", max_deaths=4)
        assert (tmp_path / "died").exists()
        assert [(r["instance"], r["attempt"], r["died"]) for r in retries] == [(0, 2, True)]
        assert "exited with status 9 during batch 2 (run 1)" in retries[0]["cause"]
        assert p.pids[0] != pid and retries[0]["pid"] == p.pids[0]
        assert [(r["k"], r["n"]) for r in _rows(replies[0])] == \
            [("a", 3)] + [(k, 2) for k in keys[1:]]
        assert _stored(shm) == {"a": 3, **{k: 2 for k in keys[1:]}}
        os.unlink(replies[0].out)
        assert _leftovers(shm) == [f"in-{s}-0.arrow" for s in (1, 2)]  # (the engine's)
    finally:
        _gone(p, shm)


def always_dies(key, pdfs, state):
    os._exit(7)


def test_an_instance_that_always_dies_fails_the_step_after_its_runs(tmp_path):
    p, shm = _pool(always_dies)
    try:
        first = p.pids[0]
        with pytest.raises(InstanceDiedError, match=r"(?s)stretch instance 0 \(pid \d+\) exited "
                           r"with status 7 during batch 1 \(run 3\).*died 3 times running its "
                           r"share of batch 1: spark.stretch.instanceMaxFailures=3"):
            p.run({0: _batch(shm, 1, [("a", 1)])}, "batch 1", max_deaths=3)
        assert p.pids[0] != first
        assert _leftovers(shm) == ["in-1-0.arrow"]
    finally:
        _gone(p, shm)


def raises_once(marker):
    def count(key, pdfs, state):
        import pandas as pd

        n = (state.get[0] if state.exists else 0) + sum(len(pdf) for pdf in pdfs)
        state.update((n,))
        if key[0] == "b" and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("flaky")
        yield pd.DataFrame({"k": [key[0]], "n": [n]})
    return count


def test_a_function_that_raises_runs_again_in_the_same_process_when_attempts_allow(tmp_path):
    # (Spark's attempts on a cluster master; in local mode there is one, tested above)
    p, shm = _pool(raises_once(str(tmp_path / "raised")))
    try:
        pid = p.pids[0]
        replies, retries = p.run({0: _batch(shm, 1, [("a", 1), ("b", 1), ("a", 1)])},
                                 "batch 1", max_raises=2)
        assert [(r["attempt"], r["died"]) for r in retries] == [(2, False)]
        assert "function failed in batch 1" in retries[0]["cause"]
        assert p.pids[0] == pid
        assert [(r["k"], r["n"]) for r in _rows(replies[0])] == [("a", 2), ("b", 1)]
        assert _stored(shm) == {"a": 2, "b": 1}
    finally:
        _gone(p, shm)
