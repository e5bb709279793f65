"""The ``StatefulProcessorHandle`` of the transformWithState drop-in's instances: a key's state
variables (value, list, map) and timers, read from the host's store when the key's call starts
and written with the instance's step (:mod:`spark_stretch.worker.processor`), so a state call
is a dictionary access, not a request to a JVM's state server.

Values are kept in Spark's internal form of their schema, as pyspark's state client sends them
(``schema.toInternal`` of the value, numpy and pandas scalars made Python's), and read back as
tuples.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
from pyspark.errors import PySparkRuntimeError
from pyspark.sql.streaming.stateful_processor import (ListState, MapState,
                                                      StatefulProcessorHandle, ValueState)
from pyspark.sql.types import ArrayType, MapType, Row, StructType

__all__ = ["StoreHandle", "Codec", "KeyState", "normalize"]


def normalize(v: Any) -> Any:
    """What pyspark's state client does to a value before it converts it (numpy scalars and
    pandas times to Python's)."""
    if isinstance(v, np.generic):
        return v.tolist()
    if isinstance(v, Row) or (isinstance(v, tuple) and hasattr(v, "_fields")):
        return type(v)(*[normalize(e) for e in v])
    if isinstance(v, (list, tuple)):
        return type(v)(normalize(e) for e in v)
    if isinstance(v, dict):
        return {normalize(k): normalize(x) for k, x in v.items()}
    if hasattr(v, "to_pytimedelta"):
        return v.to_pytimedelta()
    if hasattr(v, "to_pydatetime"):
        return v.to_pydatetime()
    return v


class Codec:
    """A state schema's conversion: Python values to Spark's internal form, and back; and a
    value stored under an earlier schema of the query (``sid``: the schema's number in the
    query's list, ``schema_of``: a number's schema) to this one, field by field by name (the
    evolution Spark allows with Avro: fields added (null), removed, reordered, widened)."""

    def __init__(self, schema: StructType, sid: int = 0, schema_of=None):
        self.schema = schema
        self.sid = sid
        self._schema_of = schema_of
        self.convert = any(f.dataType.needConversion() for f in schema.fields)
        # (a value read is the caller's to change, as natively, where each read is a new
        # object: a list or map in it must not be the stored one)
        self.nested = any(isinstance(f.dataType, (ArrayType, MapType, StructType))
                          for f in schema.fields)

    def evolve(self, stored, sid: int):
        """``stored`` (internal form of schema ``sid``) in this schema's internal form."""
        if sid == self.sid or stored is None:
            return stored
        old = dict(zip(self._schema_of(sid).names, stored))
        return tuple(old.get(name) for name in self.schema.names)

    def to_store(self, value) -> tuple:
        if value is None:
            raise PySparkRuntimeError("a state value cannot be None")
        v = tuple(normalize(x) for x in value)
        if len(v) != len(self.schema.fields):
            raise PySparkRuntimeError(
                f"state value {v!r} has {len(v)} fields, the schema "
                f"{self.schema.simpleString()} has {len(self.schema.fields)}")
        return tuple(self.schema.toInternal(v)) if self.convert else v

    def from_store(self, stored) -> tuple:
        if self.nested:
            stored = copy.deepcopy(stored)
        return tuple(self.schema.fromInternal(stored)) if self.convert else tuple(stored)


class KeyState:
    """The state of the key being called: its variables and timers, as read from the store and
    as the calls change them."""

    __slots__ = ("kb", "bucket", "key", "vars", "timers", "changed")

    def __init__(self, kb: bytes, bucket: int, key: tuple, entry):
        self.kb, self.bucket, self.key = kb, bucket, key
        if entry is None:
            self.vars: Dict[str, Any] = {}
            self.timers: set = set()
        else:
            self.vars = dict(entry[1])
            self.timers = set(entry[2])
        self.changed = False


class _Variable:
    """A state variable of the key being called. A key's entry keeps each variable as
    ``(batch written, value, schema numbers)``; a variable dropped (``deleteIfExists``) in
    batch N has no value written before N, for any key, without touching them; a value written
    with another schema of the variable is read in the current one (:meth:`Codec.evolve`)."""

    KIND = "value"

    def __init__(self, handle: "StoreHandle", name: str):
        self._h, self._name = handle, name
        self._token = handle._live[name] = object()

    def _key(self, what: str) -> KeyState:
        if self._h._live.get(self._name) is not self._token:
            raise PySparkRuntimeError(
                f"Error {what}: [STATE_STORE_UNSUPPORTED_OPERATION_ON_MISSING_COLUMN_FAMILY] "
                f"state variable {self._name!r} was removed (deleteIfExists)")
        return self._h._key()

    def _read(self, what: str):
        k = self._key(what)
        v = k.vars.get(self._name)
        if v is None or v[0] < self._h._inst.dropped.get(self._name, -1):
            return k, None
        return k, (v[1] if v[2] == self._sids() else self._evolve(v[1], v[2]))

    def _write(self, k: KeyState, value) -> None:
        if value is None:
            if k.vars.pop(self._name, None) is None:
                return
        else:
            k.vars[self._name] = (self._h._inst.batch_no, value, self._sids())
        k.changed = True

    def _sids(self) -> tuple:
        """The numbers of the schemas its values are written with."""
        return (self._codec.sid,)

    def _evolve(self, value, sids: tuple):
        """A value written with schemas ``sids`` in this variable's schemas."""
        return self._codec.evolve(value, sids[0])

    def exists(self) -> bool:
        return self._read(f"checking {self.KIND} state exists")[1] is not None

    def clear(self) -> None:
        k = self._key(f"clearing {self.KIND} state")
        self._write(k, None)


class _Value(_Variable, ValueState):
    def __init__(self, handle: "StoreHandle", name: str, codec: Codec):
        super().__init__(handle, name)
        self._codec = codec

    def get(self) -> Optional[tuple]:
        v = self._read("getting value state")[1]
        return None if v is None else self._codec.from_store(v)

    def update(self, newValue: tuple) -> None:
        k = self._key("updating value state")
        self._write(k, self._codec.to_store(newValue))


class _List(_Variable, ListState):
    KIND = "list"

    def __init__(self, handle: "StoreHandle", name: str, codec: Codec):
        super().__init__(handle, name)
        self._codec = codec

    def _evolve(self, value, sids: tuple):
        return [self._codec.evolve(v, sids[0]) for v in value]

    def get(self) -> Iterator[tuple]:
        items = self._read("getting list state")[1] or ()
        return iter([self._codec.from_store(v) for v in items])

    def put(self, newState: List[tuple]) -> None:
        k = self._key("putting list state")
        self._write(k, [self._codec.to_store(v) for v in newState] or None)

    def appendValue(self, newState: tuple) -> None:  # noqa: N802
        self.appendList([newState])

    def appendList(self, newState: List[tuple]) -> None:  # noqa: N802
        k, old = self._read("appending list state")
        items = [self._codec.to_store(v) for v in newState]
        if items:
            self._write(k, list(old or ()) + items)


class _Map(_Variable, MapState):
    KIND = "map"

    def __init__(self, handle: "StoreHandle", name: str, keys: Codec, values: Codec):
        super().__init__(handle, name)
        self._keys, self._values = keys, values

    def _sids(self) -> tuple:
        return (self._keys.sid, self._values.sid)

    def _evolve(self, value, sids: tuple):
        return {self._keys.evolve(a, sids[0]): self._values.evolve(b, sids[1])
                for a, b in value.items()}

    def _map(self, what: str):
        k, m = self._read(what)
        return k, m or {}

    def getValue(self, key: tuple) -> Optional[tuple]:  # noqa: N802
        v = self._map("getting map state value")[1].get(self._keys.to_store(key))
        return None if v is None else self._values.from_store(v)

    def containsKey(self, key: tuple) -> bool:  # noqa: N802
        return self._keys.to_store(key) in self._map("checking map state key")[1]

    def updateValue(self, key: tuple, value: tuple) -> None:  # noqa: N802
        k, m = self._map("updating map state value")
        m = dict(m)
        m[self._keys.to_store(key)] = self._values.to_store(value)
        self._write(k, m)

    def iterator(self) -> Iterator[tuple]:
        return iter([(self._keys.from_store(a), self._values.from_store(b))
                     for a, b in self._map("iterating map state")[1].items()])

    def keys(self) -> Iterator[tuple]:
        return iter([self._keys.from_store(a) for a in self._map("getting map state keys")[1]])

    def values(self) -> Iterator[tuple]:
        return iter([self._values.from_store(b)
                     for b in self._map("getting map state values")[1].values()])

    def removeKey(self, key: tuple) -> None:  # noqa: N802
        k, m = self._map("removing map state key")
        ks = self._keys.to_store(key)
        if ks in m:
            m = dict(m)
            del m[ks]
            self._write(k, m or None)


class StoreHandle(StatefulProcessorHandle):
    """The processor's handle: its state variables and timers on the key being called, in the
    instance's step of the store. Schemas given as DDL text are the ones the driver parsed
    (``spec.state_schemas``: no JVM here)."""

    def __init__(self, inst):  # (the ProcessorInstance)
        self._inst = inst
        self._time_mode = inst.time_mode.lower()
        self._live: Dict[str, object] = {}  # state name -> the token of its live variable

    def _key(self) -> KeyState:
        k = self._inst.current
        if k is None:
            raise PySparkRuntimeError(
                "[STATE_STORE_IMPLICIT_KEY_NOT_FOUND] a state variable is used outside of a "
                "call for a key (in init or close)")
        return k

    def _codec(self, schema) -> Codec:
        return self._inst.codec(schema)

    def getValueState(self, stateName: str, schema, ttlDurationMs: Optional[int] = None
                      ) -> ValueState:
        return _Value(self, stateName, self._codec(schema))

    def getListState(self, stateName: str, schema, ttlDurationMs: Optional[int] = None
                     ) -> ListState:
        return _List(self, stateName, self._codec(schema))

    def getMapState(self, stateName: str, userKeySchema, valueSchema,
                    ttlDurationMs: Optional[int] = None) -> MapState:
        return _Map(self, stateName, self._codec(userKeySchema), self._codec(valueSchema))

    def _check_timers(self, what: str) -> None:
        if self._time_mode == "none":
            raise PySparkRuntimeError(
                f"Error {what}: [STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_TIME_"
                f"MODE] Failed to perform stateful processor operation={what} with invalid "
                "timeMode=NoTime")

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("registerTimer")
        k = self._key()
        t = int(expiryTimestampMs)
        if t not in k.timers:
            k.timers.add(t)
            k.changed = True

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("deleteTimer")
        k = self._key()
        t = int(expiryTimestampMs)
        if t in k.timers:
            k.timers.discard(t)
            k.changed = True

    def listTimers(self) -> Iterator[int]:
        self._check_timers("listTimers")
        return iter(sorted(self._key().timers))

    def deleteIfExists(self, stateName: str) -> None:
        self._live.pop(stateName, None)
        self._inst.drop(stateName)
