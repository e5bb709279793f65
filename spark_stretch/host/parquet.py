"""A batch's Parquet files, read here as Spark's Parquet reader would read them, or why not.

When a micro-batch's plan is a plain Parquet scan, Spark would only read its files and hand the
rows over (``StretchIngest.parquetFiles`` in the shim decides that); the host engine reads them
itself instead. Every file is first checked to read as Spark reads it: a local file, the exact
column names, types Spark reads unchanged, and not a legacy Spark writer's (datetime rebasing).
Anything else is declined with the reason, and Spark reads the files. No library says "would
Spark read this file the same", so the checks are written out here. Declined: a file that is not
local, a column missing or matching only ignoring case, a type Spark reads otherwise (an
unannotated timestamp, an INT96 timestamp unless from a Spark 3.1+ writer, which Spark reads
unchanged, binary read as string, a narrower integer), and a legacy Spark writer's file
(datetime rebasing).

Examples
--------
>>> import pyarrow as pa, pyarrow.parquet as pq, tempfile, os
>>> from spark_stretch.host.parquet import read_like_spark
>>> d = tempfile.TemporaryDirectory()
>>> f = os.path.join(d.name, "a.parquet")
>>> pq.write_table(pa.table({"x": pa.array([1, 2], pa.int64())}), f)
>>> read_like_spark([f], ["x"], pa.schema([("x", pa.int64())])).num_rows
2
>>> read_like_spark([f], ["y"], pa.schema([("y", pa.int64())])).split(": ", 1)[1]
"no column 'y' (Spark matches names ignoring case, or reads nulls)"
>>> d.cleanup()
"""

from __future__ import annotations

import os
import re
from typing import Iterator, Union
from urllib.parse import unquote, urlparse

import pyarrow as pa

__all__ = ["file_stats", "read_like_spark", "slices_like_spark"]


def read_like_spark(files: list, columns: list, schema: pa.Schema) -> Union[pa.Table, str]:
    """``files`` read as Spark's Parquet reader would for ``columns`` of ``schema`` (a table),
    or why not (a string)."""
    tables = []
    for uri in files:
        f = _open_checked(uri, columns, schema)
        if isinstance(f, str):
            return f
        try:
            with f:
                tables.append(f.read(columns=columns, use_threads=True))
        except Exception as e:  # (Spark reports its own error, or ignores what it may)
            return f"{uri}: {type(e).__name__}: {e}"
    try:
        out = pa.concat_tables(tables) if tables else schema.empty_table()
        return out.cast(_wanted(columns, schema))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        return f"{type(e).__name__}: {e}"


def slices_like_spark(files: list, columns: list, schema: pa.Schema, rows: int
                      ) -> Union[Iterator[pa.Table], str]:
    """:func:`read_like_spark`'s table ``rows`` at a time (fewer at the end of a row group or
    file), or why not (a string): every file is checked first; each is read as the iterator
    goes, so a batch of millions of rows is never whole in memory. A read error is raised
    where it happens.

    >>> import pyarrow as pa, pyarrow.parquet as pq, tempfile, os
    >>> d = tempfile.TemporaryDirectory()
    >>> f = os.path.join(d.name, "a.parquet")
    >>> pq.write_table(pa.table({"x": pa.array(range(5), pa.int64())}), f)
    >>> got = slices_like_spark([f], ["x"], pa.schema([("x", pa.int64())]), rows=2)
    >>> [t.num_rows for t in got]
    [2, 2, 1]
    >>> d.cleanup()
    """
    paths = _checked(files, columns, schema)
    if isinstance(paths, str):
        return paths
    return _slices(paths, columns, _wanted(columns, schema), rows)


def _slices(paths: list, columns: list, want: pa.Schema, rows: int) -> Iterator[pa.Table]:
    for path in paths:
        # (column chunks read 64 KB at a time as they decode, not a row group's whole at once,
        # one column after the other: reading 1.5M rows in 65,536-row slices, the reader holds
        # 18-22 MiB, against 28-30 MiB with threads and 1 MB reads and 39 MiB with whole
        # chunks, in the same 0.05 s; 5M keys, aggstate.py: 2 B a live window less)
        with _open(path, pre_buffer=False, buffer_size=1 << 16) as f:
            for batch in f.iter_batches(batch_size=rows, columns=columns, use_threads=False):
                yield pa.Table.from_batches([batch]).cast(want)


def _checked(files: list, columns: list, schema: pa.Schema) -> Union[list, str]:
    """The local paths of ``files``, each checked to read as Spark reads it, or why not."""
    paths = []
    for uri in files:
        f = _open_checked(uri, columns, schema)
        if isinstance(f, str):
            return f
        f.close()
        paths.append(unquote(urlparse(uri).path))
    return paths


def _open_checked(uri: str, columns: list, schema: pa.Schema):
    """The local file ``uri`` open (a ``ParquetFile``, to close), checked to read as Spark
    reads it, or why not (a string)."""
    path = urlparse(uri)
    if path.scheme not in ("", "file"):
        return f"{uri} is not a local file"
    f = None
    try:
        f = _open(unquote(path.path))
        why = _unlike_spark(f, columns, schema)
    except Exception as e:  # (Spark reports its own error, or ignores what it may)
        why = f"{type(e).__name__}: {e}"
    if not why:
        return f
    if f is not None:
        f.close()
    return f"{uri}: {why}"


def _open(path: str, **options):
    import pyarrow.parquet as pq

    # (INT96 as microseconds, Spark's unit; _unlike_spark says when Spark reads it so)
    return pq.ParquetFile(path, coerce_int96_timestamp_unit="us", **options)


def _wanted(columns: list, schema: pa.Schema) -> pa.Schema:
    return pa.schema([schema.field(c) for c in columns])


def file_stats(files: list) -> list:
    """Each local file's ``[size, mtime_ns]``: what tells a file read again from the one read
    before."""
    out = []
    for uri in files:
        st = os.stat(unquote(urlparse(uri).path))
        out.append([st.st_size, st.st_mtime_ns])
    return out


def _unlike_spark(f, columns: list, schema: pa.Schema) -> str:
    """Why Spark would read ``columns`` of Parquet file ``f`` otherwise than pyarrow ('' if it
    would not)."""
    meta = f.metadata.metadata or {}  # (the file's key-value metadata)
    written = meta.get(b"org.apache.spark.version")  # by Spark, which version
    spark = tuple(int(x) for x in re.findall(r"\d+", written.decode())[:2]) if written else None
    if (spark is not None and spark < (3, 0)) \
            or any(k.startswith(b"org.apache.spark.legacy") for k in meta):
        return "written by a legacy Spark writer (datetime rebasing)"
    int96 = {f.schema.column(j).path for j in range(len(f.schema))
             if f.schema.column(j).physical_type == "INT96"}
    have = f.schema_arrow
    for c in columns:
        i = have.get_field_index(c)
        if i < 0:
            return f"no column '{c}' (Spark matches names ignoring case, or reads nulls)"
        if c in int96:
            # Spark reads INT96 unchanged only from Spark 3.1+ files without the legacy key
            # (DataSourceUtils.int96RebaseSpec); others are rebased or, from other writers,
            # time-zone converted by settings: Spark reads them.
            if spark is None or spark < (3, 1):
                return f"column '{c}' is INT96 from a non-Spark or pre-3.1 writer"
            want = schema.field(c).type
            if pa.types.is_timestamp(want) and want.tz is not None:  # (TIMESTAMP, not _NTZ)
                continue
        if not _reads_as(have.field(i).type, schema.field(c).type):
            return f"column '{c}' is {have.field(i).type}, read as {schema.field(c).type}"
    return ""


def _reads_as(file_type: pa.DataType, want: pa.DataType) -> bool:
    """Whether pyarrow's ``file_type`` holds the values Spark reads as ``want``."""
    t = pa.types
    if t.is_timestamp(want):  # INT64 TIMESTAMP(isAdjustedToUTC, MILLIS|MICROS) only
        return t.is_timestamp(file_type) and file_type.tz in ("UTC", "+00:00") \
            and file_type.unit in ("ms", "us")
    if t.is_list(want) or t.is_large_list(want):
        return (t.is_list(file_type) or t.is_large_list(file_type)) and \
            _reads_as(file_type.value_type, want.value_type)
    if t.is_string(want) or t.is_large_string(want):
        return t.is_string(file_type) or t.is_large_string(file_type)
    return file_type == want and (t.is_integer(want) or t.is_floating(want)
                                  or t.is_boolean(want) or t.is_date32(want))
