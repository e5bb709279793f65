"""The pieces of a query on several hosts that need no cluster: the host map, the TCP
challenge, one Delta commit of every host's files, the input log's driver data, and a host's
share of a batch's keys (checked against a plain-Python split of the same keys)."""

from __future__ import annotations

import os
import socket

import numpy as np
import pyarrow as pa
import pytest

from spark_stretch.engine.hashing import xxhash64
from spark_stretch.host.input_log import InputLog
from spark_stretch.host.receiver import Receiver
from spark_stretch.host.share import KeyShare
from spark_stretch.protocol import messages as M
from spark_stretch.protocol.auth import new_secret
from spark_stretch.protocol.framing import call
from spark_stretch.protocol.placement import (PlacementError, balanced_host_map,
                                              host_map_of_counts, key_group, validate_host_map)
from spark_stretch.protocol.specs import HostShare


def test_host_maps():
    assert balanced_host_map(5, 2).tolist() == [0, 0, 0, 1, 1]
    hm = host_map_of_counts([3, 1], 4, before=[0, 0, 1, 1])
    assert sorted(hm.tolist()).count(0) == 3 and hm[:2].tolist() == [0, 0]  # kept where it was
    assert host_map_of_counts([0, 4], 4, before=hm).tolist() == [1, 1, 1, 1]
    with pytest.raises(PlacementError, match="add up"):
        host_map_of_counts([1, 1], 4)
    with pytest.raises(PlacementError, match="key group 1 has host 5"):
        validate_host_map([0, 5], 2, 2)
    with pytest.raises(PlacementError, match="at least the number of hosts"):
        balanced_host_map(1, 2)


def test_share_keeps_each_key_on_exactly_one_host():
    words = [[f"w{i % 37}" for i in range(j, j + 9)] for j in range(50)] + [[], None]
    table = pa.table({"k": pa.array(words, pa.list_(pa.string())), "x": range(52)})
    hm = balanced_host_map(8, 3).tolist()
    kept = [KeyShare(HostShare(host=h, hosts=3, key_groups=8, host_map=hm), "array", "k", "ts")
            .keep(table) for h in range(3)]
    got = sorted((x, w) for t in kept for x, ws in zip(t.column("x").to_pylist(),
                                                         t.column("k").to_pylist()) for w in ws)
    assert got == sorted((x, w) for x, ws in enumerate(words) for w in (ws or []))
    group = {w: int(key_group(xxhash64(pa.array([w])), 8)[0]) for _, w in got}
    for h, t in enumerate(kept):
        assert all(hm[group[w]] == h for ws in t.column("k").to_pylist() for w in ws)
    scalar = pa.table({"k": [f"u{i}" for i in range(100)]})
    rows = [KeyShare(HostShare(host=h, hosts=3, key_groups=8, host_map=hm), "scalar", "k", "ts")
            .keep(scalar).num_rows for h in range(3)]
    assert sum(rows) == 100 and min(rows) > 0
    # pairs: the words this host does not own as a first word are flagged ~id
    share = KeyShare(HostShare(host=0, hosts=3, key_groups=8, host_map=hm), "pairs", "k", "ts")
    ids = np.arange(5, dtype=np.int64)
    vals = pa.array([f"w{i}" for i in range(5)])
    flagged = share.flag_firsts(ids, vals)
    assert [f >= 0 for f in flagged] == share.is_mine(vals).tolist()
    assert np.where(flagged >= 0, flagged, ~flagged).tolist() == ids.tolist()


def test_tcp_endpoint_refuses_peers_without_the_secret_and_serves_the_others(tmp_path):
    secret = new_secret()
    with pytest.raises(ValueError, match="address"):
        Receiver(socket_path=str(tmp_path / "x.sock"), tcp_host="0.0.0.0", secret=secret)
    with Receiver(socket_path=str(tmp_path / "r.sock"), tcp_host="127.0.0.1",
                  secret=secret) as r:
        ping = M.encode_request(M.Ping())
        assert call(r.tcp_endpoint, ping, secret=secret)["pid"] == os.getpid()
        with pytest.raises(ConnectionError):
            call(r.tcp_endpoint, ping, timeout=15, secret=b"wrong")
        for garbage in (b"", os.urandom(40), b"\x00\x00\x00\x05hello"):
            with socket.create_connection(("127.0.0.1", r.tcp_port), timeout=15) as s:
                assert s.recv(64).startswith(b"STRETCH-AUTH")
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(4096) == b""  # closed, no answer
        assert r.refused == 4
        # the Unix socket and an authenticated peer are served as before
        assert call(r.socket_path, ping)["pid"] == os.getpid()
        assert call(r.tcp_endpoint, ping, secret=secret)["pid"] == os.getpid()
        with pytest.raises(ValueError, match="secret"):
            call(r.tcp_endpoint, ping)


def test_every_hosts_files_land_as_one_delta_commit_once(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    from spark_stretch.host.delta import commit, prepare

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"k": pa.array([], pa.string()), "n": pa.array([], pa.int64())}))
    parts = [prepare(path, pa.table({"k": ["a", "b"], "n": [1, 2]}), "app", 0),
             prepare(path, pa.table({"k": ["c"], "n": [3]}), "app", 0),
             prepare(path, pa.table({"k": pa.array([], pa.string()),
                                     "n": pa.array([], pa.int64())}), "app", 0)]
    actions = [a for p in parts for a in p["actions"]]
    assert len(actions) == 2
    v0 = DeltaTable(path).version()
    assert commit(path, actions, "app", 0)["written"]
    dt = DeltaTable(path)
    assert dt.version() == v0 + 1 and dt.transaction_version("app") == 0
    assert sorted(dt.to_pyarrow_table().column("k").to_pylist()) == ["a", "b", "c"]
    # a replay: prepare and commit both see the version is there
    assert prepare(path, pa.table({"k": ["a"], "n": [1]}), "app", 0) == {"done": True}
    assert not commit(path, actions, "app", 0)["written"]
    assert DeltaTable(path).version() == v0 + 1


def test_input_log_keeps_what_the_driver_decided(tmp_path):
    log = InputLog(tmp_path)
    log.write(1, pa.table({"x": [1]}), {"stream_max_ms": [5000]})
    log.write(2, None, {"stream_max_ms": [7000]})
    log.write(3, pa.table({"x": [2]}))
    assert log.read(1, extra=True)[1] == {"stream_max_ms": [5000]}
    assert log.read(1).schema.metadata is None
    assert log.read(2, extra=True) == (None, {"stream_max_ms": [7000]})
    assert log.read(3, extra=True)[1] == {}
