"""Append a micro-batch's output to a Delta table from the host engine itself, exactly once.

A stretch query's output is already an Arrow table in the host engine. Writing it through Spark
costs a read job (executors read it back from the engine) and a Delta commit from the driver:
about 1.5 s per micro-batch on the project machine, for a few thousand rows. ``deltalake`` (the
Delta project's Rust implementation, ``delta-rs``) writes the same table as one Delta commit in
tens of milliseconds, from the process that holds the rows. No Spark import here (it runs in
the host engine process, :mod:`spark_stretch.host.daemon`).

Exactly once is Delta's own rule, as Spark's writer applies it for ``txnAppId``/``txnVersion``:
the commit carries a ``txn`` action ``(app_id, version)``, and a batch whose version the table
already holds for ``app_id`` is skipped. The driver uses this path only for a path-based Delta sink
without writer options, and only once the table exists (:func:`create` makes it empty when the
query starts, or Spark does, with the session's Delta defaults where there are some); anything ``deltalake`` cannot open or write (a
path it has no credentials for, a table feature it does not support, a schema it cannot cast to)
is reported as ``unsupported`` and the driver goes back to Spark's writer.

Examples
--------
>>> import tempfile, pyarrow as pa
>>> from deltalake import write_deltalake
>>> from spark_stretch.host.delta import append
>>> d = tempfile.TemporaryDirectory(); path = d.name
>>> write_deltalake(path, pa.table({"k": pa.array([], pa.string()), "n": pa.array([], pa.int64())}))
>>> append(path, pa.table({"k": ["a"], "n": [1]}), "app", 0)["written"]
True
>>> append(path, pa.table({"k": ["a"], "n": [1]}), "app", 0)["written"]  # a replay: no-op
False
>>> d.cleanup()
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pyarrow as pa

from . import faults

__all__ = ["append", "create", "prepare", "commit"]

# Column types a new table gets the same way from Spark and from deltalake (protocol 1/2, no
# table features); anything else (timestamp_ntz, decimals, maps, ...) Spark creates.
_PLAIN_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_int64,
                pa.types.is_int32, pa.types.is_float64, pa.types.is_float32,
                pa.types.is_boolean, pa.types.is_date32, pa.types.is_binary)

ROW_GROUP_ROWS = 1 << 18
"""Rows per Parquet row group of the files this module writes. A writer holds a row group
whole until it is written: at the default (1M rows) a close of 4.75M windows took 64 MB more
memory to write, at 262,144 rows 34 MB, and was faster (BENCHMARKS.md, aggregation state at
scale)."""


def create(path: str, schema: pa.Schema) -> dict:
    """Create an empty Delta table at ``path`` with ``schema`` (every column nullable, as Spark
    makes a sink table), as Spark would for a first write without table defaults: protocol
    1/2, no partitions, no properties. A table already there is left as it is.

    Returns ``{"created": bool, "ms": float}``, or ``{"created": False, "unsupported": why}``
    when Spark must create it (no ``deltalake``, or a column type outside the plain ones).
    """
    try:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError
    except ImportError as e:
        return {"created": False, "unsupported": f"deltalake is not installed ({e})"}
    bad = [f.name for f in schema if not _plain(f.type)]
    if bad:
        return {"created": False, "unsupported": f"column types of {bad}"}
    odd = [n for n in _names(schema) if set(n) & _ODD_NAME_CHARS]
    if odd:  # Spark takes these only with column mapping, which it sets up (or refuses)
        return {"created": False, "unsupported": f"column names {odd}"}
    t0 = time.perf_counter()
    schema = pa.schema([_nullable(f) for f in schema])
    try:
        DeltaTable(path)
        return {"created": False, "ms": (time.perf_counter() - t0) * 1e3}
    except TableNotFoundError:
        pass
    try:
        DeltaTable.create(path, schema=schema, mode="error")
    except Exception:
        DeltaTable(path)  # someone else made it meanwhile (else: this one's error)
        return {"created": False, "ms": (time.perf_counter() - t0) * 1e3}
    return {"created": True, "ms": (time.perf_counter() - t0) * 1e3}


# Characters Delta allows in column names only with column mapping (Spark's check).
_ODD_NAME_CHARS = set(" ,;{}()\n\t=")


def _names(fields) -> list:
    out = []
    for f in fields:
        out.append(f.name)
        t = f.type.value_type if pa.types.is_list(f.type) else f.type
        if pa.types.is_struct(t):
            out += _names(t)
    return out


def _plain(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return all(_plain(f.type) for f in t)
    if pa.types.is_list(t):
        return _plain(t.value_type)
    if pa.types.is_timestamp(t):
        return t.tz is not None and t.unit == "us"
    return any(f(t) for f in _PLAIN_TYPES)


def _nullable(f: pa.Field) -> pa.Field:
    t = f.type
    if pa.types.is_struct(t):
        t = pa.struct([_nullable(c) for c in t])
    elif pa.types.is_list(t):
        t = pa.list_(_nullable(t.value_field))
    return pa.field(f.name, t, nullable=True, metadata=f.metadata)


def append(path: str, table: pa.Table, app_id: str, version: int) -> dict:
    """Append ``table`` to the Delta table at ``path`` as transaction ``(app_id, version)``.

    Returns ``{"written": bool, "ms": float}``, ``written`` False when the table already holds
    that version of ``app_id`` (a replayed batch), or ``{"written": False, "unsupported": why,
    "permanent": bool}`` when Spark's writer must do it: for this batch only (no table yet) or
    from now on (no ``deltalake``, a table feature or schema it does not write). Other errors
    (I/O) propagate.
    """
    t0 = time.perf_counter()
    dt, table = _opened(path, table, app_id, version)
    if isinstance(dt, dict):
        return dict(dt, ms=(time.perf_counter() - t0) * 1e3) if "unsupported" not in dt else dt
    from deltalake import CommitProperties, Transaction, WriterProperties, write_deltalake
    from deltalake.exceptions import DeltaProtocolError, SchemaMismatchError

    faults.inject("direct", version)
    try:
        write_deltalake(dt, table, mode="append", commit_properties=CommitProperties(
            app_transactions=[Transaction(app_id, version)]),
            writer_properties=WriterProperties(max_row_group_size=ROW_GROUP_ROWS))
    except (DeltaProtocolError, SchemaMismatchError) as e:
        return _unsupported(f"deltalake cannot write the table: {e}")
    return {"written": True, "ms": (time.perf_counter() - t0) * 1e3}


def prepare(path: str, table: pa.Table, app_id: str, version: int) -> dict:
    """This host's part of a multi-host batch: ``table`` written into the Delta table's
    directory as a data file, *not* committed. Returns ``{"actions": [add action], "ms"}``
    (no action for no rows), ``{"done": True}`` if the table holds ``(app_id, version)``
    already, or ``unsupported`` as :func:`append`. :func:`commit` makes every host's files one
    commit; a file never committed (a crash in between) is not part of the table (Delta's
    VACUUM removes it)."""
    t0 = time.perf_counter()
    dt, table = _opened(path, table, app_id, version)
    if isinstance(dt, dict):
        return {"done": True} if "unsupported" not in dt else dt
    actions = []
    if table.num_rows:
        import pyarrow.parquet as pq

        name = f"part-{uuid.uuid4()}-c000.snappy.parquet"
        pq.write_table(table, os.path.join(_local(path), name), compression="snappy",
                       row_group_size=ROW_GROUP_ROWS)
        actions.append({"path": name, "size": os.path.getsize(os.path.join(_local(path), name)),
                        "partition_values": {}, "modification_time": int(time.time() * 1000),
                        "data_change": True,
                        "stats": json.dumps({"numRecords": table.num_rows})})
    return {"actions": actions, "ms": (time.perf_counter() - t0) * 1e3}


def commit(path: str, actions: list, app_id: str, version: int) -> dict:
    """Commit the data files of every host (:func:`prepare`'s add actions) as one Delta commit
    of transaction ``(app_id, version)``, unless the table holds it already (``written``
    False: a replay)."""
    from deltalake import CommitProperties, DeltaTable, Transaction
    from deltalake.transaction import AddAction

    t0 = time.perf_counter()
    dt = DeltaTable(path)
    done = dt.transaction_version(app_id)
    if done is not None and done >= version:
        return {"written": False, "ms": (time.perf_counter() - t0) * 1e3}
    faults.inject("direct", version)
    dt.create_write_transaction(
        [AddAction(**a) for a in actions], mode="append", schema=dt.schema(),
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id, version)]))
    return {"written": True, "ms": (time.perf_counter() - t0) * 1e3}


def _local(path: str) -> str:
    return path[len("file:"):] if path.startswith("file:") else path


def _opened(path: str, table: pa.Table, app_id: str, version: int):
    """``(table at path, rows cast to its schema)``, or a dict: ``{"written": False}`` when
    it holds ``(app_id, version)`` already, or why this writer cannot write it."""
    try:
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaProtocolError, TableNotFoundError
    except ImportError as e:
        return _unsupported(f"deltalake is not installed ({e})"), None
    try:
        dt = DeltaTable(path)
    except TableNotFoundError:
        return _unsupported("no Delta table at the path yet", permanent=False), None
    except DeltaProtocolError as e:
        return _unsupported(f"deltalake cannot read the table: {e}"), None
    except Exception as e:  # e.g. an object store the engine has no credentials for: Spark has
        first = (str(e).strip().splitlines() or [""])[0]  # delta-rs appends a backtrace
        return _unsupported(f"deltalake cannot open the table: {type(e).__name__}: {first}"), None
    why = _unsupported_protocol(dt)
    if why:
        return _unsupported(why), None
    done = dt.transaction_version(app_id)
    if done is not None and done >= version:
        return {"written": False}, None
    try:
        # The table's own types and nullability (Spark made the table): a plain cast, no change.
        target = pa.schema(dt.schema().to_arrow())
        if target.names != table.column_names:
            raise ValueError(f"columns {table.column_names} are not the table's {target.names}")
        for have, want in zip(table.schema, target):
            if not _same_type(have.type, want.type):
                raise TypeError(f"column '{have.name}' is {have.type}, the table's {want.type}")
        return dt, table.cast(target)
    except (ValueError, TypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        return _unsupported(f"output schema: {e}"), None


# Writer features an append needs nothing for. Others (column mapping's physical names, identity
# and generated columns, row tracking, CHECK constraints, change data feed, ...) are left to Spark.
_PLAIN_WRITER_FEATURES = {"appendOnly", "invariants", "timestampNtz"}


def _unsupported_protocol(dt) -> str:
    """Why Spark's writer, not this one, must append to ``dt`` ('' if this one may)."""
    proto = dt.protocol()
    features = set(proto.writer_features or ())
    if proto.min_writer_version <= 2 or (proto.min_writer_version == 7
                                         and features <= _PLAIN_WRITER_FEATURES):
        return ""
    extra = sorted(features - _PLAIN_WRITER_FEATURES) or f"writer version {proto.min_writer_version}"
    return f"the table needs writer features {extra}"


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal up to what a cast may change without changing a value: string sizes, timestamp units
    and zones (Delta's are microseconds, UTC) and nullability. Struct fields must have the same
    names in the same order, list elements the same type."""
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return [f.name for f in a] == [f.name for f in b] and all(
            _same_type(x.type, y.type) for x, y in zip(a, b))
    if pa.types.is_list(a) or pa.types.is_large_list(a):
        return (pa.types.is_list(b) or pa.types.is_large_list(b)) and \
            _same_type(a.value_type, b.value_type)
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        return (a.tz is None) == (b.tz is None)
    strings = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    if any(f(a) for f in strings) and any(f(b) for f in strings):
        return True
    return a == b


def _unsupported(why: str, permanent: bool = True) -> dict:
    return {"written": False, "unsupported": why, "permanent": permanent}
