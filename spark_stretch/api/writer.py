"""``result.writeStream``: starting a stretch query, as ``DataStreamWriter`` starts Spark's.

Examples
--------
>>> q = (counts.writeStream.format("delta")                      # doctest: +SKIP
...      .option("checkpointLocation", ckpt).trigger(availableNow=True).start(out))
>>> q.awaitTermination()                                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Dict, Optional

from ..driver.kind import QueryKind
from ..driver.run import QueryRun
from .query import StretchQuery

__all__ = ["StretchResult", "StretchStreamWriter"]


class StretchResult(QueryKind):
    """What a stretch call returns: a query kind to write with ``.writeStream``."""

    @property
    def isStreaming(self) -> bool:
        return True

    @property
    def writeStream(self) -> "StretchStreamWriter":
        """The writer that starts this query (mirrors ``DataFrame.writeStream``)."""
        return StretchStreamWriter(self)


class StretchStreamWriter:
    """Mirrors :class:`pyspark.sql.streaming.DataStreamWriter` for a stretch query.

    Sinks: ``delta`` (exactly once), ``parquet``/``json``/``csv``/``orc``, ``console``, ``noop``;
    triggers as in Spark (``availableNow``, ``processingTime``, ``once``).
    """

    def __init__(self, kind: QueryKind):
        self._kind = kind
        self._format = "delta"
        self._options: Dict[str, str] = {}
        self._trigger: Optional[dict] = None
        self._name: Optional[str] = None

    def format(self, source: str) -> "StretchStreamWriter":
        self._format = source.lower()
        return self

    def option(self, key: str, value) -> "StretchStreamWriter":
        self._options[key] = str(value)
        return self

    def options(self, **options) -> "StretchStreamWriter":
        for k, v in options.items():
            self.option(k, v)
        return self

    def outputMode(self, outputMode: str) -> "StretchStreamWriter":
        self._kind.output_mode(outputMode)  # (checked: a ValueError if not supported)
        return self

    def trigger(self, **kwargs) -> "StretchStreamWriter":
        self._trigger = kwargs
        return self

    def queryName(self, queryName: str) -> "StretchStreamWriter":
        self._name = queryName
        return self

    def toTable(self, tableName: str, **options) -> StretchQuery:
        """Start the query, writing to the table ``tableName``."""
        return self.options(**options)._start(path=None, table=tableName)

    def start(self, path: Optional[str] = None, format: Optional[str] = None,
              **options) -> StretchQuery:
        """Start the query, writing to ``path`` (or, for ``console``/``noop``, nowhere)."""
        if format:
            self.format(format)
        return self.options(**options)._start(path=path or self._options.pop("path", None),
                                              table=None)

    def _start(self, path: Optional[str], table: Optional[str]) -> StretchQuery:
        return StretchQuery(QueryRun.start(self._kind, self._format, dict(self._options), path,
                                           table, self._trigger, self._name))
