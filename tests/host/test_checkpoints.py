"""The host engine's checkpoint store and input log: versioned formats, the delta rule, restore.

No Spark here: the runtimes are driven directly, as the host engine drives them.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest

from spark_stretch.host.aggregate import AggregateRuntime
from spark_stretch.host.checkpoints import CheckpointStore
from spark_stretch.host.grouped import GroupedRuntime
from spark_stretch.host.input_log import InputLog
from spark_stretch.protocol import messages as M
from spark_stretch.protocol.errors import StateError
from spark_stretch.protocol.layout import AGGREGATE_META, GROUPED_META, INPUT_LOG_KEY
from spark_stretch.protocol.specs import AggregateSpec, Checkpointing, GroupedSpec


class _Nowhere:
    def offer(self, stream, table):
        pass


class _Kept:
    """A receiver that keeps each batch's output rows."""

    def __init__(self):
        self.rows = {}

    def offer(self, stream, table):
        if table is not None:
            self.rows[stream.rsplit(":", 1)[-1]] = sorted(table.to_pylist(), key=repr)


def _spec(state_dir, resume=None, interval=1):
    return AggregateSpec(ts_column="ts", delay_ms=0, key_kind="scalar", key_column="k",
                         key_type="string", window_us=10_000_000, slide_us=10_000_000,
                         aggs=[("count", None)], parallelism=2, max_parallelism=2, buckets=64,
                         resume_batch=resume,
                         checkpoint=Checkpointing(state_dir=str(state_dir), interval=interval))


def _batch(keys, t_s):
    return pa.table({"ts": pa.array(np.full(len(keys), int(t_s * 1e6)), pa.timestamp("us", "UTC")),
                     "k": pa.array(keys, pa.string())})


def _run(rt, batches, await_result=False):
    out = []
    for b, (keys, t) in enumerate(batches):
        rt.ingest(f"in:{b}", "j", _batch(keys, t))
        rt.submit(b, await_result=await_result)  # (logs the input, as a pipelined query does)
        reply = rt.result(b)
        rt.wait_saved()
        out.append(reply)
    return out


BATCHES = [(["a", "b", "a"], 1), (["b", "c"], 12), (["a"], 25), (["c", "c"], 38)]


@pytest.mark.parametrize("await_result", [False, True])
def test_a_restart_from_checkpoint_and_log_continues_exactly(tmp_path, await_result):
    # await_result: the input logged while the batch steps (inside Spark's plan)
    rt = AggregateRuntime("q", _spec(tmp_path / "state", interval=2), _Nowhere())
    rows_a = [r.rows for r in _run(rt, BATCHES, await_result)]
    assert rt.store.stats["kind"] == "log" and rt.store.stats["checkpoint"] == 2
    rt.close()
    assert InputLog(tmp_path / "input").batches() == [3]
    # After batch 3: the checkpoint of 2, then batch 3 again from the input log.
    again = AggregateRuntime("q", _spec(tmp_path / "state", resume=3), _Nowhere())
    assert again.describe().checkpoint == 2 and again.replay == [2, 3]
    replayed = [again.step(b) for b in again.replay]
    assert [r.rows for r in replayed] == rows_a[2:]
    assert again.counters["batches"] == 4
    again.close()


def test_an_input_log_write_that_fails_fails_its_batch_and_stops_the_runtime(tmp_path,
                                                                            monkeypatch):
    # Logged beside the step (await_result), a failed write still fails the batch (Spark does
    # not commit it), and nothing more is stepped on state the log could not redo.
    rt = AggregateRuntime("q", _spec(tmp_path / "state", interval=10), _Nowhere())
    _run(rt, BATCHES[:1], await_result=True)

    def full(*_):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(rt.log, "write", full)
    rt.ingest("in:1", "j", _batch(*BATCHES[1]))
    rt.submit(1, await_result=True)
    with pytest.raises(StateError, match=r"the input of batch 1 could not be logged: .*No space "
                                         r"left on device.*restart the query from its checkpoint"):
        rt.result(1)
    monkeypatch.undo()
    rt.ingest("in:2", "j", _batch(*BATCHES[2]))
    with pytest.raises(StateError, match="could not be logged"):
        rt.step(2)
    rt.close()
    assert InputLog(tmp_path / "input").batches() == []  # (batch 0's went with its checkpoint)


def _files_run(rt, tmp_path, batches):
    """``batches`` written as Parquet files and read by the engine itself (the files route),
    submitted as a pipelined query does; the replies."""
    import pyarrow.parquet as pq

    out = []
    for b, (keys, t) in enumerate(batches):
        f = tmp_path / "src" / f"part-{b}.parquet"
        f.parent.mkdir(exist_ok=True)
        table = _batch(keys, t)
        pq.write_table(table, f)
        got = rt.ingest_files(M.IngestFiles(query="q", batch=b, files=[f.as_uri()],
                                            columns=["ts", "k"],
                                            schema=M.schema_to_wire(table.schema),
                                            watermarks=["ts"]))
        assert got.unsupported is None and got.rows == len(keys)
        rt.submit(b)
        out.append(rt.result(b))
        rt.wait_saved()
    return out


def test_a_batch_read_from_files_is_logged_by_reference_and_replayed_from_them(tmp_path):
    # The engine read the batch's Parquet files itself: its log entry names the files (as
    # Spark's file source logs them), not the rows; a restart reads them again.
    first = _Kept()
    rt = AggregateRuntime("q", _spec(tmp_path / "state", interval=10), first)
    _files_run(rt, tmp_path, BATCHES)
    rt.close()
    log = InputLog(tmp_path / "input")
    assert log.batches() == [1, 2, 3]  # (batch 0's went with its checkpoint)
    assert sorted(p.name for p in log.path.iterdir()) == ["1.files", "2.files", "3.files"]
    assert log.read(2).files == [(tmp_path / "src" / "part-2.parquet").as_uri()]
    for d in ("state", "input"):  # (as the run left them: each restart below starts there)
        shutil.copytree(tmp_path / d, tmp_path / "left" / d)

    def restart(receiver=_Nowhere()):
        for d in ("state", "input"):
            shutil.rmtree(tmp_path / d)
            shutil.copytree(tmp_path / "left" / d, tmp_path / d)
        return AggregateRuntime("q", _spec(tmp_path / "state", resume=3), receiver)

    second = _Kept()
    again = restart(second)
    # (0: the checkpoint's own output again, then 1-3 from their files)
    assert again.describe().checkpoint == 0 and again.replay == [0, 1, 2, 3]
    for b in again.replay:
        again.step(b)
    assert second.rows == first.rows and len(first.rows) == 4  # (the oracle: the first run)
    assert sum(map(len, first.rows.values())) > 0
    again.close()
    # A file changed or gone since: refused, naming the batch and the file.
    part = tmp_path / "src" / "part-2.parquet"
    for spoil, error in [(lambda: part.write_bytes(b"not the batch's rows"),
                          r"batch 2's input file .*part-2.parquet changed since the batch read it"),
                         (part.unlink, r"batch 2's input file is gone .*Spark's file source needs "
                                       r"them")]:
        spoil()
        again = restart()
        again.step(0), again.step(1)
        with pytest.raises(StateError, match=error):
            again.step(2)
        again.close()


def test_a_checkpoint_of_an_unknown_format_is_refused_naming_the_file(tmp_path):
    rt = AggregateRuntime("q", _spec(tmp_path / "state"), _Nowhere())
    _run(rt, BATCHES[:2])
    rt.close()
    meta = tmp_path / "state" / "1" / AGGREGATE_META
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), format=99)))
    with pytest.raises(StateError, match=rf"{meta} has format 99; this version of spark-stretch "
                                         "reads format 1"):
        AggregateRuntime("q", _spec(tmp_path / "state", resume=1), _Nowhere())
    # nothing held: the checkpoint lock is free for the next try
    store = CheckpointStore(Checkpointing(state_dir=str(tmp_path / "state")), AGGREGATE_META)
    store.hold_lock(timeout=1)
    store.release_lock()


def test_an_input_log_file_of_an_unknown_format_is_refused(tmp_path):
    log = InputLog(tmp_path)
    log.write(0, _batch(["a"], 1))
    log.write(1, None)
    assert log.read(0).column("k").to_pylist() == ["a"] and log.read(1) is None
    t = _batch(["a"], 1)
    t = t.replace_schema_metadata({INPUT_LOG_KEY: b"7"})
    with pa.OSFile(str(tmp_path / "2.arrow"), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t)
    with pytest.raises(StateError, match=r"2.arrow has format 7; this version of spark-stretch "
                                         "reads format 1"):
        log.read(2)
    with pytest.raises(StateError, match="the input of batch 5 is neither pending nor in the "
                                         "input log"):
        log.read(5)


def test_a_drop_in_checkpoint_of_the_old_placement_is_refused(tmp_path):
    state = tmp_path / "state" / "0"
    state.mkdir(parents=True)
    (state / GROUPED_META).write_text(json.dumps({"format": 1, "kind": "full", "buckets": 8}))
    spec = GroupedSpec(key_columns=["k"], columns=["k"], out_schema="{}", state_schema="{}",
                       output_mode="Update", timeout_conf="NoTimeout", buckets=8,
                       resume_batch=0, checkpoint=Checkpointing(state_dir=str(tmp_path / "state")))
    with pytest.raises(StateError, match="has format 1; this version of spark-stretch reads "
                                         "format 2"):
        GroupedRuntime("q", spec, _Nowhere())


def test_delta_checkpoints_follow_spark_state_store_rule(tmp_path):
    store = CheckpointStore(Checkpointing(state_dir=str(tmp_path), min_deltas=3), AGGREGATE_META)
    assert not store.delta_due(0, 0.1)  # the first one is full
    kinds = []
    for b, changed in enumerate([0.1, 0.1, 0.1, 0.1, 0.9, 0.1]):
        delta = store.delta_due(b, changed)
        store.save(b, delta, {}, lambda: {"x": b"1"}, {})
        store.join()
        kinds.append(store.stats["kind"])
    # full, then deltas until a chain holds min_deltas, full when most of the state changed
    assert kinds == ["full", "delta", "delta", "full", "full", "delta"]
    assert store.chain_of(5) == [4, 5] and store.latest(10) == 5
    assert not store.delta_due(6, 0.1, full=True)
