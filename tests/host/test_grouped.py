"""The drop-in's runtime (host/grouped.py) without Spark: its checkpoints, and several hosts.

Checkpoints: a delta promoted to a full checkpoint in the background; a restore from either is
the live store's state (oracle: the live store's entries). Several hosts: two host runtimes of
one query each step the rows routed to them (each row's bucket computed as Spark's
``pmod(xxhash64(k), B)``, ``driver/routing.py``), move key groups after a batch through their
checkpoints, and step on. Oracle: one runtime holding every key group on the same batches; the
union of the two hosts' outputs equals its output, batch by batch, timeouts included."""

from __future__ import annotations

import base64

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql.types import LongType, StringType, StructField, StructType

from spark_stretch.engine.hashing import xxhash64
from spark_stretch.host.grouped import BUCKET, GroupedRuntime
from spark_stretch.protocol.errors import BadRequest, StateError
from spark_stretch.protocol.placement import balanced_host_map
from spark_stretch.protocol.specs import Checkpointing, GroupedSpec, HostShare

G, B = 4, 16
OUT = StructType([StructField("k", StringType()), StructField("n", LongType()),
                  StructField("closed", LongType())])
STATE = StructType([StructField("n", LongType()), StructField("end", LongType())])


def sessions(key, pdfs, state):
    """A count per key that closes 5 s of event time after the key's last row."""
    if state.hasTimedOut:
        n, _ = state.get
        state.remove()
        yield pd.DataFrame({"k": [key[0]], "n": [n], "closed": [1]})
        return
    n, end = state.get if state.exists else (0, 0)
    for pdf in pdfs:
        n += len(pdf)
        end = max(end, int(pdf["ts"].max().value // 10 ** 6))
    state.update((n, end))
    state.setTimeoutTimestamp(max(end + 5000, state.getCurrentWatermarkMs()))
    yield pd.DataFrame({"k": [key[0]], "n": [n], "closed": [0]})


class _Offers:
    def __init__(self):
        self.out = {}

    def offer(self, stream, table):
        self.out[stream] = table


def counts(key, pdfs, state):
    """A running count per key (no timeout)."""
    n, _ = state.get if state.exists else (0, 0)
    for pdf in pdfs:
        n += len(pdf)
    state.update((n, 0))
    yield pd.DataFrame({"k": [key[0]], "n": [n], "closed": [0]})


def _spec(state_dir, share, resume=None, min_deltas=10, func=sessions,
          timeout="EventTimeTimeout"):
    return GroupedSpec(
        key_columns=["k"], columns=["k", "ts"], out_schema=OUT.json(),
        state_schema=STATE.json(), output_mode="Update", timeout_conf=timeout,
        ts_column="ts", delay_ms=2000, watermark_present=True, runner_conf={"timezone": "UTC"},
        parallelism=2, max_parallelism=2, buckets=B, resume_batch=resume, share=share,
        func=base64.b64encode(cloudpickle.dumps(func)).decode(),
        checkpoint=Checkpointing(state_dir=str(state_dir), min_deltas=min_deltas))


def _batches(n=7, rows=120, keys=30):
    rng = np.random.default_rng(5)
    out = []
    for b in range(n):
        ts = (b * 4000 + rng.integers(0, 4000, rows)) * 1000  # (us)
        k = pa.array([f"u{x}" for x in rng.integers(8 * b, 8 * b + keys, rows)])  # (keys age out)
        t = pa.table({"k": k, "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))})
        out.append(t.append_column(BUCKET, pa.array(
            (xxhash64(k) % B).astype(np.int32))))  # (Spark's pmod: % of numpy is one)
    return out


def _watermarks(batches):
    """Spark's [W_{N-1}, W_N] of each batch: the largest event time before it, minus 2 s."""
    marks, top, w = [], None, 0
    for t in batches:
        prev, w = w, max(w, 0 if top is None else top - 2000)
        marks.append([prev, w])
        hi = t.column("ts").cast(pa.int64()).to_numpy().max() // 1000
        top = hi if top is None else max(top, hi)
    return marks


def _rows(rt, stream):
    t = rt.receiver.out.get(stream)
    return [] if t is None else t.to_pylist()


class _Hosts:
    """The hosts of one query (``None``: one host holding every group, the oracle's)."""

    def __init__(self, root, host_map):
        self.root = root
        self.rts = []
        self.open(host_map, None)

    def open(self, host_map, resume):
        n = max(host_map) + 1
        self.host_map = list(host_map)
        self.rts = [GroupedRuntime("q", _spec(self.root / "hosts" / str(h) / "state",
                                              HostShare(host=h, hosts=n, key_groups=G,
                                                        host_map=self.host_map), resume),
                                   _Offers()) for h in range(n)]

    def step(self, b, table, marks):
        hosts = np.asarray(self.host_map)[table.column(BUCKET).to_numpy() % G]
        out = []
        for h, rt in enumerate(self.rts):
            rt.ingest(f"in:{b}", "j", table.filter(pa.array(hosts == h)))
            out += _rows(rt, rt.step(b, 0, watermarks=marks).stream)
        return sorted(map(str, out))

    def move(self, host_map):
        last = self.rts[0].last_batch
        for rt in self.rts:
            rt.flushed()  # (every host's full state of the last batch: Recovery.move_groups)
            rt.close()
        self.open(host_map, last)

    def close(self):
        for rt in self.rts:
            rt.close()


@pytest.mark.slow  # (for time: the default run stays under 20 minutes; CI runs -m slow)
def test_moving_key_groups_between_hosts_keeps_every_key_and_timer(tmp_path):
    batches = _batches()
    marks = _watermarks(batches)
    one = _Hosts(tmp_path / "one", [0] * G)
    two = _Hosts(tmp_path / "two", balanced_host_map(G, 2).tolist())
    moves = {2: [1] * G, 4: [0, 1, 0, 1]}  # every group to host 1, then back to both
    try:
        closed = 0
        for b, t in enumerate(batches):
            want = one.step(b, t, marks[b])
            assert two.step(b, t, marks[b]) == want, f"batch {b}"
            closed += sum("'closed': 1" in r for r in want)
            if b in moves:
                two.move(moves[b])
                keys = [rt.state_keys for rt in two.rts]
                assert sum(keys) == one.rts[0].state_keys
                if b == 2:  # host 0 holds nothing, host 1 every key
                    assert keys[0] == 0
        assert closed > 0  # (timers moved with their keys and fired on their new host)
        # each host's checkpoint says how it placed its keys, and its host map
        two.rts[1].wait_saved()
        meta = two.rts[1].store.read_meta(len(batches) - 1)
        assert meta["placement"] == "xxhash64" and meta["host_map"] == [0, 1, 0, 1]
    finally:
        one.close()
        two.close()


def test_each_host_reports_its_rows_per_key_group_for_the_policy(tmp_path):
    # the elastic policy moves key groups by these loads; oracle: the rows' groups counted
    # from Spark's hash of their keys
    batches = _batches(2)
    marks = _watermarks(batches)
    hosts = _Hosts(tmp_path, balanced_host_map(G, 2).tolist())
    try:
        for b, t in enumerate(batches):
            hosts.step(b, t, marks[b])
            groups = xxhash64(t.column("k")) % G
            for h, rt in enumerate(hosts.rts):
                got = dict(rt.last_reply.metrics["elastic"]["group_load"])
                want = {int(g): int((groups == g).sum()) for g in np.unique(groups)
                        if hosts.host_map[g] == h}
                assert got == want, (b, h)
    finally:
        hosts.close()


def test_a_checkpoint_of_the_other_placement_is_refused(tmp_path):
    batches = _batches(2)
    marks = _watermarks(batches)
    two = _Hosts(tmp_path, balanced_host_map(G, 2).tolist())
    for b, t in enumerate(batches):
        two.step(b, t, marks[b])
    two.close()
    # the same checkpoint opened as a query on one host (its buckets by the engine's hash)
    spec = _spec(tmp_path / "hosts" / "0" / "state", None, resume=1)
    with pytest.raises(StateError, match="written by the query on several hosts, and it runs "
                                         "on one now"):
        GroupedRuntime("q", spec, _Offers())


def test_buckets_must_be_a_multiple_of_the_key_groups(tmp_path):
    spec = _spec(tmp_path, HostShare(host=0, hosts=2, key_groups=3, host_map=[0, 1, 0]))
    with pytest.raises(BadRequest, match="buckets=16 on several hosts: must be a multiple of "
                                         r"spark.stretch.keyGroups \(3\)"):
        GroupedRuntime("q", spec, _Offers())


def _one(state_dir, resume=None, min_deltas=3):
    """A running count on one host (of its kind: buckets from the rows)."""
    share = HostShare(host=0, hosts=1, key_groups=G, host_map=[0] * G)
    return GroupedRuntime("q", _spec(state_dir / "state", share, resume, min_deltas, counts,
                                     "NoTimeout"), _Offers())


def _count_batches(n):
    """500 keys, then batches touching at most 60 of them (a delta each: few keys changed)."""
    rng = np.random.default_rng(7)
    out = []
    for b in range(n):
        k = pa.array([f"u{x}" for x in (range(500) if b == 0 else rng.integers(0, 60, 120))])
        t = pa.table({"k": k, "ts": pa.array(np.full(len(k), b * 1_000_000),
                                              pa.timestamp("us", tz="UTC"))})
        out.append(t.append_column(BUCKET, pa.array((xxhash64(k) % B).astype(np.int32))))
    return out


def test_a_long_chain_of_deltas_is_promoted_to_a_full_checkpoint_in_the_background(tmp_path):
    batches = _count_batches(7)
    rt = _one(tmp_path)
    live = {}
    try:
        for b, t in enumerate(batches):
            rt.ingest(f"in:{b}", "j", t)
            rt.step(b, 0)
            live[b] = dict(rt.kv.entries())  # (batch 3's copy is made while batch 4 runs)
        rt.wait_saved()
        rt._join_promotion()
        kinds = {b: rt.store.read_meta(b)["kind"] for b in range(len(batches))}
    finally:
        rt.close()
    # full first; a delta every batch after, those ending a chain of three made full later
    assert kinds == {0: "full", 1: "delta", 2: "delta", 3: "full", 4: "delta", 5: "delta",
                     6: "full"}
    d = tmp_path / "state" / "6"
    assert (d / "state.mdb.zst").exists() and not list(d.glob("changes-*.arrow"))
    assert list((tmp_path / "state" / "5").glob("changes-*.arrow"))
    for resume, chain in ((6, [6]), (4, [3, 4])):
        again = _one(tmp_path, resume=resume)
        try:
            assert again.store.chain_of(resume) == chain
            assert dict(again.kv.entries()) == live[resume]
        finally:
            again.close()


def test_a_promotion_that_never_finishes_leaves_the_deltas_to_restore_from(tmp_path,
                                                                           monkeypatch):
    from spark_stretch.host.checkpoints import CheckpointStore

    monkeypatch.setattr(CheckpointStore, "promote", lambda *a, **k: 1 / 0)  # (a crash in it)
    batches = _count_batches(5)
    rt = _one(tmp_path)
    try:
        for b, t in enumerate(batches):
            rt.ingest(f"in:{b}", "j", t)
            rt.step(b, 0)
        rt.wait_saved()
        rt._join_promotion()
        live = dict(rt.kv.entries())
        assert "ZeroDivisionError" in rt.promoted["error"]
    finally:
        rt.close()
    again = _one(tmp_path, resume=4)
    try:
        assert again.store.chain_of(4) == [0, 1, 2, 3, 4]
        assert dict(again.kv.entries()) == live
    finally:
        again.close()


def test_a_format_3_checkpoint_uncompressed_is_restored_and_goes_on(tmp_path):
    # Format 4 compresses the full copy (a zstd stream) and the changelogs (Arrow's zstd
    # buffers); a checkpoint written by the version before (format 3: both as they are) restores
    # to the same entries and the query goes on. Oracle: the same batches on one runtime
    # that never stopped.
    import json

    batches = _count_batches(5)
    rt = _one(tmp_path / "a", min_deltas=10)
    try:
        for b, t in enumerate(batches[:3]):
            rt.ingest(f"in:{b}", "j", t)
            rt.step(b, 0)
        rt.wait_saved()
        live = dict(rt.kv.entries())
    finally:
        rt.close()
    state = tmp_path / "a" / "state"
    zst = state / "0" / "state.mdb.zst"
    assert zst.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # (zstd's frame magic)
    for b in range(3):  # written by this version, then rewritten as format 3 wrote it
        meta = json.loads((state / str(b) / "grouped.json").read_text())
        assert meta["format"] == 4
        (state / str(b) / "grouped.json").write_text(json.dumps({**meta, "format": 3}))
        for f in (state / str(b)).glob("changes-*.arrow"):
            log = pa.ipc.open_file(str(f)).read_all()
            sink = pa.BufferOutputStream()
            with pa.ipc.new_file(sink, log.schema) as w:
                w.write_table(log)
            plain = sink.getvalue().to_pybytes()
            assert f.stat().st_size < len(plain)  # (it was compressed)
            f.write_bytes(plain)
    with pa.CompressedInputStream(str(zst), "zstd") as src:
        (state / "0" / "state.mdb").write_bytes(src.read())
    zst.unlink()

    again = _one(tmp_path / "a", resume=2, min_deltas=10)
    whole = _one(tmp_path / "b", min_deltas=10)
    try:
        assert dict(again.kv.entries()) == live
        for b, t in enumerate(batches):
            whole.ingest(f"in:{b}", "j", t)
            whole.step(b, 0)
            if b >= 3:
                again.ingest(f"in:{b}", "j", t)
                again.step(b, 0)
        assert dict(again.kv.entries()) == dict(whole.kv.entries())
        again.wait_saved()
        assert again.store.read_meta(4)["format"] == 4
    finally:
        again.close()
        whole.close()


def stuck(key, pdfs, state):
    """A function that does not return (a step that outlives its driver)."""
    import time

    time.sleep(600)
    yield pd.DataFrame({"k": [key[0]], "n": [0], "closed": [0]})


def test_an_engine_left_by_its_driver_mid_step_removes_its_files_on_the_host(tmp_path):
    # The driver is gone while a step runs (its instances busy in the function): the engine
    # waits a few seconds for the query to close, then kills the instances and removes the
    # step files (shared memory) and the state store (local disk) before it exits: nobody
    # else removes them if the query is never restarted.
    import threading
    import time

    from spark_stretch.host.daemon import HostDaemon

    share = HostShare(host=0, hosts=1, key_groups=G, host_map=[0] * G)
    rt = GroupedRuntime("q", _spec(tmp_path / "state", share, func=stuck, timeout="NoTimeout"),
                        _Offers())
    daemon = HostDaemon(str(tmp_path / "engine.sock"))
    daemon.queries["q"] = rt
    procs = [inst.proc for inst in rt.pool.instances]
    rt.ingest("in:0", "j", _count_batches(1)[0])
    stepping = threading.Thread(target=lambda: pytest.raises(Exception, rt.step, 0, 0),
                                daemon=True)
    stepping.start()
    time.sleep(2.0)  # (the instances are in the function)
    assert rt.shm.exists() and rt.state_dir.exists()
    t0 = time.monotonic()
    daemon.serve(parent=1)  # (not this process's parent: orphaned at once)
    assert time.monotonic() - t0 < 30
    for p in procs:  # (killed: they end at once, whatever their function does)
        p.wait(timeout=10)
    assert not rt.shm.exists() and not rt.state_dir.exists()
    stepping.join(30)
    assert not stepping.is_alive()
