"""The README's examples that run without a server run here, as written (paths moved under the
test's temporary directory)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(section: str) -> str:
    text = README.read_text().split(f"## {section}", 1)[1]
    return text.split("```python", 1)[1].split("```", 1)[0]


def test_holding_a_query_to_native_spark(spark, tmp_path):
    code = _block("Holding a query to native Spark").replace('"/tmp/', f'"{tmp_path}/')
    scope = {"spark": spark}
    exec(compile(code, "README.md", "exec"), scope)  # its own assert compares the two
    rows = scope["sorted_rows"](scope["run_native"](spark, scope["agg"], tmp_path / "native"))
    assert len(rows) > 1000  # windows did close: the comparison was not of two empty tables
