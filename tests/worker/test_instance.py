"""An instance process of the drop-in, driven as the host engine drives it (no Spark session).

Oracle: a sequential run of the same function over the same keys in plain Python.
"""

from __future__ import annotations

import os
import pickle
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


@pytest.fixture
def pool():
    shm = Path(tempfile.mkdtemp(prefix="stretch-test-worker-", dir="/dev/shm"))
    spec = GroupedSpec(key_columns=["k"], columns=["k", "x"], out_schema=OUT.json(),
                       state_schema=STATE.json(), output_mode="Update",
                       timeout_conf="NoTimeout", buckets=4, max_parallelism=1,
                       runner_conf={"timezone": "UTC"})
    p = InstancePool(1, shm, I.Init(spec=spec, func=cloudpickle.dumps(running_count),
                                    shm=str(shm), index=0))
    yield p, shm
    p.stop()
    for f in shm.iterdir():
        f.unlink()
    shm.rmdir()


def _batch(shm, seq, rows):
    """One batch of ``rows`` (key, x), all keys in bucket ``hash(k) % 4``, sorted by (bucket, key)."""
    rows = sorted(rows, key=lambda r: (hash(r[0]) % 4, r[0]))
    t = pa.table({"k": [r[0] for r in rows], "x": [r[1] for r in rows]})
    starts = [i for i in range(len(rows)) if i == 0 or rows[i][0] != rows[i - 1][0]]
    path = I.input_file(shm, seq, 0)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t)
    return I.Batch(batch=seq, seq=seq, flush=False, owned=np.arange(4), reload=np.arange(0),
                   batch_ts_ms=0, watermark_ms=0, input=str(path),
                   starts=np.asarray(starts, np.int64),
                   group_buckets=np.asarray([hash(rows[i][0]) % 4 for i in starts], np.int64))


def _rows(done: I.BatchDone):
    with pa.memory_map(done.out) as src:
        return sorted(pa.ipc.open_file(src).read_all().to_pylist(), key=lambda r: r["k"])


def test_keys_are_called_in_order_and_their_state_kept_in_bucket_files(pool):
    p, shm = pool
    batches = [[("a", 1), ("b", 2), ("a", 3)], [("b", 1), ("c", 5)], [("a", 0)]]
    counts = {}
    for seq, rows in enumerate(batches, 1):
        done = p.run({0: _batch(shm, seq, rows)}, seq)[0]
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
        p.run({0: _batch(shm, 1, [("a", -1)])}, 1)


def test_a_killed_instance_is_reported_not_waited_for(pool):
    p, shm = pool
    os.kill(p.pids[0], signal.SIGKILL)
    with pytest.raises(InstanceDiedError, match=r"stretch instance 0 \(pid \d+\) was killed by "
                                                r"signal 9 during batch 1"):
        p.run({0: _batch(shm, 1, [("a", 1)])}, 1)
