"""A batch the engine reads from its Parquet files, kept as its files until its step and read a
slice at a time (``host/file_batch.py``): the windows a sequential reference computes, Spark's
event-time statistics of the whole batch, bad rows refused at the ingest with the batch's own
count, and a file changed in between refused at the step."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from spark_stretch.host import aggregations
from spark_stretch.host.aggregate import AggregateRuntime
from spark_stretch.host.file_batch import FileBatch
from spark_stretch.host.parquet import read_like_spark, slices_like_spark
from spark_stretch.protocol import messages as M
from spark_stretch.protocol.errors import InputRejected, StateError
from spark_stretch.protocol.specs import AggregateSpec, Checkpointing
from tests.host.test_aggregate import WINDOW_US, _batches, _Kept, _reference, _windows


def _spec(tmp_path):
    return AggregateSpec(ts_column="ts", delay_ms=0, key_kind="scalar", key_column="user",
                         key_type="long", window_us=WINDOW_US, slide_us=WINDOW_US,
                         aggs=[("count", None), ("sum", "x"), ("max", "x")],
                         value_types={"x": "long"}, parallelism=2, max_parallelism=2,
                         buckets=64, checkpoint=Checkpointing(state_dir=str(tmp_path / "st")))


def _files(tmp_path, b, table, parts=2, row_group=700):
    """``table`` as ``parts`` Parquet files of row groups of ``row_group`` rows; the message
    that hands them to the engine."""
    paths, step = [], -(-table.num_rows // parts)
    for i in range(parts):
        p = tmp_path / "src" / f"b{b}-{i}.parquet"
        p.parent.mkdir(exist_ok=True)
        pq.write_table(table.slice(i * step, step), p, row_group_size=row_group)
        paths.append(p.as_uri())
    return M.IngestFiles(query="q", batch=b, files=paths, columns=table.schema.names,
                         schema=M.schema_to_wire(table.schema), watermarks=["ts"])


def _event_times(table):
    """Spark's event-time statistics of the whole batch, from every row at once (ms)."""
    ms = np.floor_divide(pc.cast(table.column("ts"), pa.int64()).to_numpy(), 1000)
    return [(int(ms.max()), int(ms.min()), float(ms.mean()), len(ms))]


def test_a_batch_kept_as_its_files_and_read_in_slices_gives_the_reference_windows(
        tmp_path, monkeypatch):
    batches = _batches()
    monkeypatch.setattr(aggregations, "SLICE_ROWS", 1_000)
    kept = _Kept()
    rt = AggregateRuntime("q", _spec(tmp_path), kept)
    eng, sizes = rt.engines[0], []
    apply = eng._process_segment
    monkeypatch.setattr(eng, "_process_segment", lambda seg: (sizes.append(len(seg)),
                                                              apply(seg))[1])
    try:
        for b, t in enumerate(batches + [None]):
            if t is not None:
                got = rt.ingest_files(_files(tmp_path, b, t))
                assert got.unsupported is None and got.rows == t.num_rows
                assert got.event_times[0][:2] == _event_times(t)[0][:2]
                assert got.event_times[0][2] == pytest.approx(_event_times(t)[0][2], rel=1e-12)
                assert got.event_times[0][3] == t.num_rows
                # (no rows held between the ingest and the step: the files, and their count)
                assert isinstance(rt.pending[b], FileBatch)
            reply = rt.step(b)
            assert reply.rows == kept.out[reply.stream].num_rows
        assert rt.counters["input_rows"] == sum(t.num_rows for t in batches)
    finally:
        rt.close()
    # (5,000-row batches in two files of 700-row groups: slices of at most 1,000 rows)
    assert max(sizes) <= 1_000 and len(sizes) >= 3 * 6
    rows = pa.concat_tables([kept.out[f"q:out:{b}"] for b in range(len(batches) + 1)])
    assert _windows(rows) == _reference(batches)


def test_null_keys_in_files_fail_the_ingest_with_the_whole_batch_count(tmp_path, monkeypatch):
    monkeypatch.setattr(aggregations, "SLICE_ROWS", 100)
    t = _batches(n=1_000, batches=1)[0]
    users = t.column("user").to_pylist()
    for i in (5, 450, 990):  # (in three different slices)
        users[i] = None
    t = t.set_column(1, "user", pa.array(users, pa.int64()))
    rt = AggregateRuntime("q", _spec(tmp_path), _Kept())
    try:
        with pytest.raises(InputRejected, match=r"keys column 'user' has 3 null keys in batch 0"):
            rt.ingest_files(_files(tmp_path, 0, t))
        assert 0 not in rt.pending
    finally:
        rt.close()


def test_a_file_changed_between_its_ingest_and_its_step_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(aggregations, "SLICE_ROWS", 100)
    t = _batches(n=1_000, batches=1)[0]
    rt = AggregateRuntime("q", _spec(tmp_path), _Kept())
    try:
        msg = _files(tmp_path, 0, t)
        rt.ingest_files(msg)
        pq.write_table(t.slice(0, 10), msg.files[1].removeprefix("file://"))
        with pytest.raises(StateError, match=r"batch 0's input file .*b0-1.parquet changed since "
                                             r"the batch read it"):
            rt.step(0)
    finally:
        rt.close()


def test_slices_read_the_rows_a_whole_read_gives_and_refuse_as_it_does(tmp_path):
    t = _batches(n=2_345, batches=1)[0]
    msg = _files(tmp_path, 0, t, parts=3, row_group=300)
    schema = M.schema_from_wire(msg.schema)
    whole = read_like_spark(msg.files, msg.columns, schema)
    got = list(slices_like_spark(msg.files, msg.columns, schema, rows=128))
    assert max(s.num_rows for s in got) == 128
    assert pa.concat_tables(got).equals(whole) and whole.num_rows == 2_345
    # (a column Spark would read otherwise: the same reason from both, nothing read)
    wrong = pa.schema([("ts", pa.timestamp("us", "UTC")), ("user", pa.int32()),
                       ("x", pa.int64())])
    why = read_like_spark(msg.files, msg.columns, wrong)
    assert isinstance(why, str) and "column 'user' is int64, read as int32" in why
    assert slices_like_spark(msg.files, msg.columns, wrong, rows=128) == why
