"""Typed messages, specs and error codes: what crosses between processes, and what is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spark_stretch.protocol import messages as M
from spark_stretch.protocol.errors import (BadRequest, ErrorCode, InputRejected, RemoteError,
                                           StateError, error_reply, raise_for)
from spark_stretch.protocol.specs import (SPEC_VERSION, AggregateSpec, Checkpointing,
                                          GroupedSpec, OperatorSpec, StreamSpec, spec_from_wire,
                                          spec_to_wire)

SAMPLES = [
    M.Write(stream="q:in:0", job="j", partition=1, task=7, attempt=0),
    M.Commit(stream="q:in:0", job="j", attempts=[(0, 3), (1, 7)]),
    M.Abort(stream="q:in:0", job="j"), M.Schema(stream="s"), M.Read(stream="s", split=1, splits=4),
    M.Ping(), M.Open(query="q", spec={"kind": "aggregate"}),
    M.IngestFiles(query="q", batch=3, files=["file:/a.parquet"], columns=["ts"], schema="AAA=",
                  watermarks=["ts"]),
    M.Step(query="q", batch=2, batch_ts_ms=1000), M.Submit(query="q", batch=2),
    M.Result(query="q", batch=2), M.Saved(query="q"), M.Flush(query="q"), M.Flushed(query="q"),
    M.WriteDelta(query="q", stream="q:out:2", path="/t", app_id="a", version=2),
    M.CreateDelta(path="/t", schema="AAA="),
    M.Reconfigure(query="q", parallelism=2, owner_map=[0, 1, 1, 0]), M.Metrics(query="q"),
    M.Cancel(query="q", batch=4), M.Close(query="q"), M.Shutdown(),
    M.Submit(query="q", batch=2, stream_max_ms=[5000, None]),
    M.Submit(query="q", batch=2, watermark_ms=4000, await_result=True),
    M.PrepareDelta(query="q", stream="q:out:3", path="/t", app_id="a", version=3),
    M.CommitDelta(query="q", path="/t", app_id="a", version=3,
                  actions=[{"path": "part-0.parquet", "size": 10, "partition_values": {},
                            "modification_time": 1, "data_change": True,
                            "stats": "{\"numRecords\": 1}"}]),
]


def test_every_operation_has_a_message_that_round_trips():
    ops = {type(m).op for m in SAMPLES}
    assert ops == set(M._REQUESTS), "a request type without a sample here"
    for msg in SAMPLES:
        wire = M.encode_request(msg)
        assert wire["v"] == M.PROTOCOL_VERSION and wire["op"] == msg.op
        assert M.decode_request(json.loads(json.dumps(wire))) == msg


@pytest.mark.parametrize("header,needle", [
    ({"v": 1, "op": "launch"}, "unknown op 'launch'"),
    ({"v": 1}, "unknown op None"),
    ({"v": 1, "op": 3}, "unknown op 3"),
    ({"op": "step", "query": "q", "batch": 1}, "protocol version None"),
    ({"v": 2, "op": "step", "query": "q", "batch": 1}, "protocol version 2"),
    ({"v": 1, "op": "step", "query": "q"}, "missing required field `batch`"),
    ({"v": 1, "op": "step", "query": "q", "batch": "1"}, r"Expected `int`, got `str` - at `\$.batch`"),
    ({"v": 1, "op": "commit", "stream": "s", "job": "j", "attempts": [[0]]}, "attempts"),
    ({"v": 1, "op": "reconfigure", "query": "q", "owner_map": ["a"]}, "owner_map"),
])
def test_a_header_that_is_not_ours_is_a_bad_request_naming_what(header, needle):
    with pytest.raises(BadRequest, match=needle):
        M.decode_request(header)


def test_unknown_fields_are_ignored_so_a_newer_peer_may_add_some():
    assert M.decode_request({"v": 1, "op": "ping", "trace": "x"}) == M.Ping()


def test_replies_decode_typed_and_drop_unset_fields():
    reply = M.decode_reply(M.Reconfigure(query="q"), {
        "ok": True, "epoch": 2, "parallelism": 3, "switch_ms": 0.2, "after_batch": 5,
        "live_windows": 10, "moved_buckets": None})
    assert reply == M.Reconfigured(epoch=2, parallelism=3, switch_ms=0.2, after_batch=5,
                                   live_windows=10)
    assert reply.to_dict() == {"epoch": 2, "parallelism": 3, "switch_ms": 0.2, "after_batch": 5,
                               "live_windows": 10}
    with pytest.raises(BadRequest, match="reply to 'step'"):
        M.decode_reply(M.Step(query="q", batch=1), {"ok": True, "rows": "many"})


def test_errors_cross_with_their_code():
    reply = error_reply(InputRejected("keys column 'k' has 1 null keys in batch 2"))
    assert reply == {"ok": False, "code": "INPUT_REJECTED",
                     "error": "keys column 'k' has 1 null keys in batch 2"}
    with pytest.raises(RemoteError) as e:
        raise_for(reply)
    assert e.value.code is ErrorCode.INPUT_REJECTED and "null keys" in str(e.value)
    try:
        {}["missing"]
    except KeyError as err:
        internal = error_reply(err)
    assert internal["code"] == "INTERNAL"
    assert internal["error"].startswith("KeyError: 'missing' (at test_messages.py:")
    with pytest.raises(RemoteError) as e:
        raise_for({"ok": False, "code": "NO_SUCH_CODE", "error": "x"})
    assert e.value.code is ErrorCode.INTERNAL
    assert error_reply(StateError("gone"))["code"] == "STATE"


SPECS = [
    AggregateSpec(ts_column="ts", delay_ms=10_000, key_kind="pairs", key_column="words",
                  key_type="string", distance=3, window_us=60_000_000, slide_us=30_000_000,
                  aggs=[("count", None), ("sum", "len")], value_types={"len": "long"},
                  checkpoint=Checkpointing(state_dir="/c/stretch/state", interval=3),
                  resume_batch=7),
    OperatorSpec(operator="gASV", streams=[StreamSpec(name="df", ts_column="ts", delay_ms=5000,
                                                      columns=[("x", "double", "x")])],
                 output=[("key", "long", "key")], window_us=None, watermark_policy="max"),
    GroupedSpec(key_columns=["user"], columns=["ts", "user"], out_schema="{}", state_schema="{}",
                output_mode="Update", timeout_conf="NoTimeout", runner_conf={"timezone": "UTC"}),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_query_specs_round_trip_with_their_kind_and_version(spec):
    wire = json.loads(json.dumps(spec_to_wire(spec)))
    assert wire["kind"] == spec.kind and wire["version"] == SPEC_VERSION
    assert spec_from_wire(wire) == spec


def test_a_spec_of_another_version_or_kind_is_refused():
    wire = spec_to_wire(SPECS[0])
    with pytest.raises(BadRequest, match="query spec version 2: this engine reads version 1"):
        spec_from_wire(dict(wire, version=2))
    with pytest.raises(BadRequest, match="unknown query kind 'sql'"):
        spec_from_wire(dict(wire, kind="sql"))
    with pytest.raises(BadRequest, match=r"aggregate query spec: .*window_us"):
        spec_from_wire(dict(wire, window_us="a minute"))
    assert dataclasses.replace(SPECS[0], resume_batch=None).resume_batch is None
