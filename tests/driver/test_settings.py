"""The settings registry: the README's Settings table is the registry, and bad values are named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spark_stretch.driver.settings import SETTINGS, read_settings

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_table() -> dict:
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"^\| `(spark\.stretch\.[\w.]+)` \| `?([^`|]*)`? \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def test_the_readme_lists_exactly_the_registered_settings_with_their_defaults_and_docs():
    table = _readme_table()
    assert list(table) == list(SETTINGS)
    for key, (default, doc) in table.items():
        assert default == (SETTINGS[key].default or "(none)"), key
        assert doc == SETTINGS[key].doc, key


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


def test_defaults_read_from_an_empty_session():
    s = read_settings(_Conf())
    assert (s.on_failure, s.max_restarts, s.checkpoint_interval, s.fsync, s.direct_write,
            s.read_files, s.columnar, s.niceness, s.min_deltas, s.min_batches_to_retain) == \
        ("restart", 3, 10, False, True, True, True, 5, 10, 100)


@pytest.mark.parametrize("key,value,needle", [
    ("spark.stretch.onEngineFailure", "retry", "must be 'restart' (restart the engine"),
    ("spark.stretch.maxEngineRestarts", "x", "must be an integer >= 0"),
    ("spark.stretch.engine.niceness", "20", "must be an integer from 0 to 19"),
    ("spark.stretch.checkpoint.fsync", "yes", "must be 'true' (fsync each engine checkpoint"),
    ("spark.stretch.testClockMs", "soon", "must be '<start>[+<step>]' in milliseconds"),
])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(key, value, needle):
    with pytest.raises(ValueError) as e:
        read_settings(_Conf({key: value}))
    assert str(e.value).startswith(f"{key}='{value}': ") and needle in str(e.value)
