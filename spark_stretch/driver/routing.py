"""Which hosts a row must reach, computed by Spark: a query on several hosts, the rows path.

Each row goes to each host that owns at least one of its keys, once per such host (never once
per key): the route is an ``array<int>`` of host indices, added as the last column, which the
shim's writer (``StretchDataWriter``, option ``route``) reads to send the row to those hosts'
engines, and drops. A key's host is ``host_map[pmod(xxhash64(key), G)]`` (Spark's own
``xxhash64``; integral keys as ``bigint``), the function every host's engine applies to keep
its keys (:mod:`spark_stretch.host.share`). A row with no key goes to host 0: its event time
still counts for the watermark. A batch whose key the engine computes itself (``stretch(df)``
evaluating the input projection on the engine) has no key column yet: each of its rows goes to
every host, which keeps its own keys.

The ``applyInPandasWithState`` drop-in groups by several columns of any type: its rows carry
their bucket, ``pmod(xxhash64(k1, k2, ...), B)`` (:data:`BUCKET`), which the engine reads
instead of hashing the key itself; its key group is the bucket's ``pmod(bucket, G)`` (``B`` a
multiple of ``G``: the same as ``pmod(xxhash64(k1, ...), G)``) and its host the host map's.
"""

from __future__ import annotations

from typing import List

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import IntegralType

from ..protocol.placement import BUCKET

__all__ = ["BUCKET", "ROUTE", "bucket_column", "route", "route_grouped"]

ROUTE = "__stretch_route"


def _host_of(key: Column, host_map: Column, key_groups: int) -> Column:
    group = F.pmod(F.xxhash64(key), F.lit(key_groups))
    return F.element_at(host_map, (group + 1).cast("int"))


def route(df: DataFrame, key_kind: str, key_column: str, host_map: List[int],
          key_groups: int, hosts: int) -> DataFrame:
    """``df`` with :data:`ROUTE` last: the hosts (of ``hosts``) owning the keys of each row
    (``key_kind`` ``scalar``, ``array`` or ``pairs`` of the column ``key_column``)."""
    if key_column not in df.columns:
        return df.withColumn(ROUTE, F.array(*[F.lit(i) for i in range(hosts)]))
    hm = F.array(*[F.lit(int(h)) for h in host_map])
    col = F.col(f"`{key_column}`")
    if key_kind == "scalar":
        if isinstance(df.schema[key_column].dataType, IntegralType):
            col = col.cast("bigint")
        hosts = F.array(_host_of(col, hm, key_groups))
    else:
        elem = df.schema[key_column].dataType.elementType
        cast = isinstance(elem, IntegralType)
        hosts = F.array_distinct(F.transform(
            F.coalesce(col, F.array().cast(df.schema[key_column].dataType)),
            lambda w: _host_of(w.cast("bigint") if cast else w, hm, key_groups)))
        hosts = F.when(F.size(hosts) == 0, F.array(F.lit(0))).otherwise(hosts)
    return df.withColumn(ROUTE, hosts)


def bucket_column(keys: List[str], buckets: int):
    """The bucket of ``buckets`` of a row whose grouping columns are ``keys``: Spark's
    ``xxhash64`` of them, modulo ``buckets`` (the drop-ins' placement on several hosts)."""
    return F.pmod(F.xxhash64(*[F.col(f"`{k}`") for k in keys]), F.lit(buckets)).cast("int")


def route_grouped(df: DataFrame, keys: List[str], buckets: int, host_map: List[int],
                  key_groups: int) -> DataFrame:
    """``df`` with :data:`BUCKET` (each row's bucket of ``buckets``, :func:`bucket_column`)
    and :data:`ROUTE` last (the host of the bucket's key group, of ``host_map``)."""
    b = bucket_column(keys, buckets)
    hm = F.array(*[F.lit(int(h)) for h in host_map])
    return (df.withColumn(BUCKET, b)
            .withColumn(ROUTE, F.array(F.element_at(
                hm, (F.pmod(F.col(BUCKET), F.lit(key_groups)) + 1).cast("int")))))
