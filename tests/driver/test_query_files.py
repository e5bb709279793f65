"""The driver's own files under a checkpoint carry a format the reader checks: ``query.json``
(the query's ids) and ``flush.json`` (the drop-in's no-data batch timestamp)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from spark_stretch.api.grouped import StretchGroupedAggregation
from spark_stretch.driver.recovery import query_ids
from spark_stretch.protocol.errors import StateError
from spark_stretch.protocol.layout import QueryLayout


def test_query_ids_are_kept_and_a_file_of_another_format_is_refused(tmp_path):
    layout = QueryLayout(str(tmp_path))
    ids = query_ids(layout)
    assert query_ids(layout) == ids  # a restart is the same query
    assert json.loads(layout.query_file.read_text())["format"] == 1
    layout.query_file.write_text(json.dumps({"format": 3, "stretch_id": "x", "app_id": "y"}))
    with pytest.raises(StateError, match=r"query.json has format 3; this version of "
                                         "spark-stretch reads format 1"):
        query_ids(layout)


def test_a_flush_timestamp_is_kept_for_replays_and_another_format_refused(tmp_path):
    layout = QueryLayout(str(tmp_path))
    layout.root.mkdir(parents=True)
    query = SimpleNamespace(layout=layout, last_done=4,
                            settings=SimpleNamespace(test_clock="1000+10"))
    kind = StretchGroupedAggregation.__new__(StretchGroupedAggregation)  # (no DataFrame needed)
    assert kind.flush_time(query, at_ms=1234) == 1050  # batch 5's time on the test clock
    query.settings.test_clock = None
    assert kind.flush_time(query, at_ms=1234) == 1234  # the start of the trigger it stands for
    # kept before its rows reach the sink: a replay of the same no-data batch runs at its time
    kind.keep_flush_time(query, 4, 1, 1234)
    assert kind.kept_flush_time(query, 4, 1) == 1234
    assert kind.kept_flush_time(query, 4, 0) is None and kind.kept_flush_time(query, 5, 1) is None
    layout.flush_file.write_text(json.dumps({"format": 1, "batch": 4, "batch_ts_ms": 7}))
    assert kind.kept_flush_time(query, 4, 0) == 7  # (written before "seq": the first one)
    layout.flush_file.write_text(json.dumps({"format": 2, "batch": 4, "batch_ts_ms": 1}))
    with pytest.raises(StateError, match=r"flush.json has format 2"):
        kind.kept_flush_time(query, 4, 0)
