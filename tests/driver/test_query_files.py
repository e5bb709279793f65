"""The driver's own file under a checkpoint carries a format the reader checks: ``query.json``
(the query's ids)."""

from __future__ import annotations

import json

import pytest

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
