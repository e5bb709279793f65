"""An instance process of the drop-in, driven as the host engine drives it (no Spark session).

Oracle: a sequential run of the same function over the same keys in plain Python.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql.types import LongType, StringType, StructField, StructType

from spark_stretch.engine.keyed import KeyedStore
from spark_stretch.host.instances import InstancePool
from spark_stretch.protocol import instances as I
from spark_stretch.protocol.errors import InstanceDiedError, UserFunctionError
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
    (shm / "state").mkdir()
    spec = GroupedSpec(key_columns=["k"], columns=["k", "x"], out_schema=OUT.json(),
                       state_schema=STATE.json(), output_mode="Update",
                       timeout_conf="NoTimeout", buckets=4, max_parallelism=1,
                       runner_conf={"timezone": "UTC"})
    return InstancePool(1, shm, I.Init(spec=spec, func=cloudpickle.dumps(func), shm=str(shm),
                                       index=0, state=str(shm / "state"))), shm


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
    return I.Batch(batch=seq, seq=seq, owned=np.arange(4),
                   batch_ts_ms=0, watermark_ms=0, input=str(path),
                   starts=np.asarray(starts, np.int64),
                   group_buckets=np.asarray([_bucket(rows[i][0]) for i in starts], np.int64))


def _rows(done: I.BatchDone):
    with pa.memory_map(done.out) as src:
        return sorted(pa.ipc.open_file(src).read_all().to_pylist(), key=lambda r: r["k"])


def test_keys_are_called_in_order_and_their_state_kept_in_the_store(pool):
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
    # every key's state is in the store under its bucket, as Spark's internal row
    assert _stored(shm) == counts
    kv = KeyedStore(shm / "state")
    assert sorted((int.from_bytes(kb[:2], "big"), e[0][0]) for kb, e in kv.entries()) == \
        sorted((_bucket(k), k) for k in counts)
    kv.close()


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
    kv = KeyedStore(shm / "state")
    try:
        return {e[0][0]: e[1][0] for _, e in kv.entries()}
    finally:
        kv.close()


def _leftovers(shm):
    """What a step may leave in the shared-memory directory: its input (the engine's), and
    outputs and changelogs of replies (the engine takes them)."""
    return sorted(f.name for f in shm.iterdir()
                  if f.name != "state" and not f.name.endswith(".log"))


def dies_in_commit(marker, after: bool):
    """A running count whose instance, once (``marker``), dies while it applies its step to the
    store: just before its write transaction (``after`` False) or just after it committed,
    before its reply."""
    def count(key, pdfs, state):
        import pandas as pd

        if not os.path.exists(marker):
            open(marker, "w").close()
            from spark_stretch.engine import keyed

            commit = keyed.Step.commit

            def dying(self, *a, **kw):
                if not after:
                    os._exit(9)
                r = commit(self, *a, **kw)
                os._exit(9)
                return r

            keyed.Step.commit = dying
        n = state.get[0] if state.exists else 0
        n += sum(len(pdf) for pdf in pdfs)
        state.update((n,))
        yield pd.DataFrame({"k": [key[0]], "n": [n]})
    return count


@pytest.mark.parametrize("after", [False, True], ids=["before-commit", "after-commit"])
def test_an_instance_dying_in_its_commit_leaves_each_count_counted_once(tmp_path, after):
    # Batch 2's run dies just before (its share runs again on batch 1's state) or just after
    # (the new process answers from the step's marker, without running it twice) its commit.
    p, shm = _pool(dies_in_commit(str(tmp_path / "died"), after))
    try:
        keys = ["a", "b", "c", "d", "e", "f"]
        assert len({_bucket(k) for k in keys}) == 4  # several buckets change in each batch
        open(tmp_path / "died", "w").close()  # batch 1 runs as is
        done = p.run({0: _batch(shm, 1, [(k, 1) for k in keys])}, "batch 1", max_deaths=4)
        os.unlink(done[0][0].out)
        os.unlink(done[0][0].changes)
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
        assert replies[0].changed_rows == len(keys)
        os.unlink(replies[0].out)
        os.unlink(replies[0].changes)
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


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_a_batch_costs_the_keys_it_touches_not_the_state_it_holds(pool):
    # The live keys grow tenfold over ten batches of as many new keys: each batch writes its own
    # keys only (its changelog, the checkpoint's delta, the same size), and takes as long at the
    # end as at the start (the pickled buckets before the store rewrote every bucket touched).
    p, shm = pool
    per, sizes, ms = 2000, [], []
    for seq in range(1, 11):
        done = p.run({0: _batch(shm, seq, [(f"u{seq:02d}-{i:05d}", 1) for i in range(per)])},
                     f"batch {seq}")[0][0]
        assert done.changed_rows == per and done.calls == per
        sizes.append(os.path.getsize(done.changes))
        ms.append(done.times["data_ms"] + done.times["write_ms"])
        for f in (done.out, done.changes, I.input_file(shm, seq, 0)):
            os.unlink(f)
    kv = KeyedStore(shm / "state")
    assert kv.rows() == 10 * per
    kv.close()
    assert max(sizes) <= 1.02 * min(sizes), sizes
    assert min(ms[-3:]) <= 1.5 * max(ms[1:4]) + 20, ms  # (noise: the best of the last three)
