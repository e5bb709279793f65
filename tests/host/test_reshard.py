"""Key groups moving between hosts (host/reshard.py), without Spark: two host runtimes of one
query step the same batches (each keeping its groups' keys), move groups after a batch through
their checkpoints, and step on; the union of their outputs equals one host's on the same input,
batch by batch."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from spark_stretch.host.aggregate import AggregateRuntime
from spark_stretch.protocol.placement import balanced_host_map, host_map_of_counts
from spark_stretch.protocol.specs import AggregateSpec, Checkpointing, HostShare
from spark_stretch.testing import tweets_table

G = 8


class _Offers:
    def __init__(self):
        self.out = {}

    def offer(self, stream, table):
        self.out[stream] = table


def _spec(kind, state_dir=None, share=None, resume=None, interval=3):
    key = {"array": ("array", "words", "string"), "pairs": ("pairs", "words", "string"),
           "scalar": ("scalar", "user", "string"), "hll": ("scalar", "user", "string")}[kind]
    aggs = [("count", None)] + ([("first", "first_word"), ("max", "len")] if kind == "scalar"
                                else [("hll13", "len", "ok")] if kind == "hll" else [])
    types = {"scalar": {"first_word": "string", "len": "long"},
             "hll": {"len": "long", "ok": "long"}}.get(kind, {})
    return AggregateSpec(
        ts_column="ts", delay_ms=2000, key_kind=key[0], key_column=key[1], key_type=key[2],
        distance=2 if kind == "pairs" else None, window_us=20_000_000, slide_us=10_000_000,
        aggs=aggs, value_types=types, parallelism=2, max_parallelism=2, buckets=32, resume_batch=resume, share=share,
        checkpoint=Checkpointing(state_dir=None if state_dir is None else str(state_dir),
                                 interval=interval))


def _batches(n=8):
    t = tweets_table(n * 150, rate=40.0, vocab=60, seed=3, late_fraction=0.05, jitter_s=3.0)
    t = t.append_column("first_word", pa.compute.list_element(t.column("words"), 0))
    t = t.append_column("ok", pa.array(np.ones(len(t), np.int64)))  # (HLL++'s take flag)
    return [t.slice(i * 150, 150) for i in range(n)]


def _rows(table):
    return sorted(map(str, table.to_pylist())) if table is not None else []


def _one_host(kind, batches):
    rt = AggregateRuntime("q", _spec(kind), _Offers())
    outs = []
    for b, t in enumerate(batches):
        rt.ingest(f"in:{b}", "j", t)
        outs.append(_rows(rt.receiver.out[rt.step(b).stream]))
    rt.close()
    return outs


def _step_all(hosts, b, t):
    """Batch ``b`` (table ``t``) on every host runtime: the union of their outputs' rows."""
    outs = []
    for rt in hosts:
        rt.ingest(f"in:{b}", "j", t)  # (each keeps its share of every row)
        outs.append(rt.receiver.out[rt.step(b).stream])
    return _rows(pa.concat_tables(outs))


def _hosts(kind, root, host_map, resume=None, n=2):
    """The query's ``n`` host runtimes (under ``root``), opened after ``resume``."""
    return [AggregateRuntime("q", _spec(kind, root / "hosts" / str(h) / "state",
                                        HostShare(host=h, hosts=n, key_groups=G,
                                                  host_map=list(host_map)), resume), _Offers())
            for h in range(n)]


@pytest.mark.parametrize("kind", ["array", "pairs", "scalar", "hll"])
def test_moving_key_groups_between_hosts_keeps_every_window(kind, tmp_path):
    batches = _batches()
    want = _one_host(kind, batches)
    hm = balanced_host_map(G, 2).tolist()
    hosts = _hosts(kind, tmp_path, hm)
    got = []
    moves = {2: [G, 0], 5: [3, 5]}  # after batch 2: every group to host 0; after 5: 3 and 5
    for b, t in enumerate(batches):
        got.append(_step_all(hosts, b, t))
        if b in moves:
            for rt in hosts:  # every host's full state of batch b, then the new host map
                rt.flushed()
                rt.close()
            hm = host_map_of_counts(moves[b], G, before=hm).tolist()
            hosts = _hosts(kind, tmp_path, hm, resume=b)
            assert all(rt.checkpoint == b for rt in hosts)
    for rt in hosts:
        rt.close()
    assert got == want
    assert sum(len(b) for b in want) > 50


@pytest.mark.parametrize("kind", ["array", "pairs"])
def test_a_move_reads_only_the_checkpoints_of_the_groups_a_host_gains(kind, tmp_path,
                                                                       monkeypatch):
    # Three hosts; after batch 2 host 0's groups go to host 1. Host 1 reads its own checkpoint
    # and host 0's, host 0 only its own (it drops what it lost), host 2 is not resharded at all.
    from spark_stretch.host import reshard

    read = []
    real = reshard._source
    monkeypatch.setattr(reshard, "_source", lambda d, *a: read.append(d) or real(d, *a))
    batches = _batches()
    want = _one_host(kind, batches)
    hm = balanced_host_map(G, 3).tolist()
    hosts = _hosts(kind, tmp_path, hm, n=3)
    got = []
    for b, t in enumerate(batches):
        got.append(_step_all(hosts, b, t))
        if b == 2:
            for rt in hosts:
                rt.flushed()
                rt.close()
            new = [1 if h == 0 else h for h in hm]
            opened = []
            for h in range(3):  # (one at a time: which checkpoints each one read)
                read.clear()
                opened.append(AggregateRuntime("q", _spec(
                    kind, tmp_path / "hosts" / str(h) / "state",
                    HostShare(host=h, hosts=3, key_groups=G, host_map=new), 2), _Offers()))
                slots = sorted(int(d.split("/hosts/")[1].split("/")[0]) for d in read)
                assert slots == [[0], [0, 1], []][h], (h, read)
            hosts = opened
    for rt in hosts:
        rt.close()
    assert got == want


@pytest.mark.parametrize("kind", ["array", "pairs", "scalar"])
def test_a_lost_hosts_groups_restored_on_the_other_from_its_checkpoint_and_log(kind, tmp_path):
    # Host 1 is lost after batch 4 (its last checkpoint is of batch 3: interval 3, batch 4 in
    # its input log): host 0 takes every group, from both hosts' checkpoints of batch 3 and
    # both input logs of batch 4, and runs on alone
    batches = _batches()
    want = _one_host(kind, batches)
    hm = balanced_host_map(G, 2).tolist()
    hosts = _hosts(kind, tmp_path, hm)
    got = []
    for b, t in enumerate(batches[:5]):
        outs = []
        for rt in hosts:
            rt.ingest(f"in:{b}", "j", t)
            rt.submit(b)  # (the pipelined path: the input logged first)
            outs.append(rt.receiver.out[rt.result(b).stream])
        got.append(_rows(pa.concat_tables(outs)))
    for rt in hosts:
        rt.store.join()
        rt.close()
    alone = AggregateRuntime("q", _spec(kind, tmp_path / "hosts" / "0" / "state",
                                        HostShare(host=0, hosts=2, key_groups=G,
                                                  host_map=[0] * G), resume=4), _Offers())
    assert alone.checkpoint == 3 and alone.replay == [4]
    replayed = alone.receiver.out[alone.step(4).stream]  # (the driver steps it again)
    assert _rows(replayed) == got[4]
    for b, t in enumerate(batches[5:], start=5):
        alone.ingest(f"in:{b}", "j", t)
        got.append(_rows(alone.receiver.out[alone.step(b).stream]))
    alone.close()
    assert got == want


@pytest.mark.parametrize("kind", ["array", "scalar"])
def test_a_new_host_given_key_groups_takes_their_state(kind, tmp_path):
    # One host runs the query; after batch 3 a second host joins and gets half the groups,
    # their state from the first host's checkpoint of batch 3
    batches = _batches()
    want = _one_host(kind, batches)

    def host(h, n, hm, resume=None):
        return AggregateRuntime("q", _spec(kind, tmp_path / "hosts" / str(h) / "state",
                                           HostShare(host=h, hosts=n, key_groups=G,
                                                     host_map=hm), resume), _Offers())

    hosts, got = [host(0, 1, [0] * G)], []
    for b, t in enumerate(batches):
        got.append(_step_all(hosts, b, t))
        if b == 3:
            hosts[0].flushed()
            hosts[0].close()
            hm = host_map_of_counts([4, 4], G, before=[0] * G).tolist()
            hosts = [host(0, 2, hm, resume=3), host(1, 2, hm, resume=3)]
            assert hosts[1].replay == [] and hosts[1].engines[0].live_windows() > 0
    for rt in hosts:
        rt.close()
    assert got == want


@pytest.mark.parametrize("kind", ["array", "pairs", "scalar"])
def test_each_host_reports_the_keys_of_its_key_groups(kind, tmp_path):
    # what an elastic controller moves groups by: each host's step figures carry the keys of
    # each of its groups (a pair: its first word), together the batch's keys per group
    from spark_stretch.engine.hashing import xxhash64
    from spark_stretch.protocol.placement import key_group

    t = _batches(1)[0]
    col = t.column("user" if kind == "scalar" else "words")
    keys = col if kind == "scalar" else pa.compute.list_flatten(col)
    want = np.bincount(key_group(xxhash64(keys), G), minlength=G)
    hm = [0, 1, 1, 0, 0, 1, 0, 1]
    got = np.zeros(G, np.int64)
    for h, rt in enumerate(_hosts(kind, tmp_path, hm)):
        rt.ingest("in:0", "j", t)
        for g, n in rt.step(0).metrics["elastic"]["group_load"]:
            assert hm[g] == h
            got[g] += n
        rt.close()
    assert got.tolist() == want.tolist() and want.min() > 0


@pytest.mark.parametrize("typ", [pa.int64(), pa.string()])
def test_a_null_key_is_in_the_group_sparks_routing_gives_it(typ):
    """Spark's ``xxhash64`` of a null is its seed (42), so the driver routes a null key to key
    group ``42 % G``; a host keeps it there too (a nullable key column's null group)."""
    from spark_stretch.host.share import KeyShare

    host_map = [1 if g == 42 % G else 0 for g in range(G)]  # (not the group of a hash 0)
    for h in range(2):
        share = KeyShare(HostShare(host=h, hosts=2, key_groups=G, host_map=host_map),
                         "scalar", "k", "ts")
        assert share.is_mine(pa.array([None], typ)).tolist() == [host_map[42 % G] == h]


def test_a_checkpoint_keeping_a_nullable_key_as_bytes_is_refused(tmp_path):
    """A checkpoint with no record of its keys was written when a nullable key column was kept
    as interned bytes of Spark's row: read as values, its windows would be other keys."""
    from dataclasses import replace

    from spark_stretch.protocol.errors import StateError

    spec = replace(_spec("scalar", tmp_path / "state", interval=1), key_nullable=True)
    rt = AggregateRuntime("q", spec, _Offers())
    for b, t in enumerate(_batches(2)):
        rt.ingest(f"in:{b}", "j", t)
        rt.step(b)
    rt.close()
    meta = next((tmp_path / "state").glob("**/1/*.json"))
    assert json.loads(meta.read_text())["keys"] == "scalar:string?"
    AggregateRuntime("q", replace(spec, resume_batch=1), _Offers()).close()  # (as written: fine)
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items()
                                if k != "keys"}))
    with pytest.raises(StateError, match="column 'user' as scalar:binary, this version as "
                                         "scalar:string\\?.*new checkpoint location"):
        AggregateRuntime("q", replace(spec, resume_batch=1), _Offers())
