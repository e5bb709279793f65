"""The ``StatefulProcessorHandle`` of the transformWithState drop-in's instances: a key's state
variables (value, list, map) and timers, read from the host's store when the key's call starts
and written with the instance's step (:mod:`spark_stretch.worker.processor`), so a state call
is a dictionary access, not a request to a JVM's state server.

Values are kept in Spark's internal form of their schema, as pyspark's state client sends them
(``schema.toInternal`` of the value, numpy and pandas scalars made Python's), and read back as
tuples. A variable with a TTL (``ttlDurationMs``, processing time only, as in Spark) keeps an
expiry with its value, each list element, each map key: the batch's timestamp plus the TTL when
written; what has expired is not read, and is dropped at the batch's end (the key's earliest
expiry is one of its timers in the store, :data:`TTL_TIMERS`).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
from pyspark.errors import PySparkRuntimeError
from pyspark.sql.streaming.stateful_processor import (ListState, MapState,
                                                      StatefulProcessorHandle, ValueState)
from pyspark.sql.types import ArrayType, MapType, Row, StructType

__all__ = ["StoreHandle", "Codec", "KeyState", "normalize", "prune_expired", "TTL_TIMERS"]

# A key's earliest state expiry (TTL) is a timer in the store's timer index above this offset
# (a timer's milliseconds are far below it), so a batch finds the keys whose state expired
# without reading the others, as Spark's TTL index does.
TTL_TIMERS = 1 << 61


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
            self.timers = {t for t in entry[2] if t < TTL_TIMERS}
        self.changed = False


def prune_expired(variables: Dict[str, Any], now: int, count=None) -> Optional[int]:
    """Drop what has expired (expiry <= ``now``, Spark's ``StateTTL.isExpired``) from a key's
    variables written with a TTL (``(batch, value, schemas, expiry)``: one expiry for a value,
    one per element of a list, one per key of a map); return the earliest expiry left.
    ``count(metric, n)``: told how many values went (``numValuesRemovedDueToTTLExpiry``)."""
    soonest = []
    for name, v in list(variables.items()):
        if len(v) < 4:
            continue
        live, exps = _alive(v[1], v[3], now)
        left = [] if live is None else _expiries(exps)
        gone = len(_expiries(v[3])) - len(left)
        if count is not None and gone:
            count("numValuesRemovedDueToTTLExpiry", gone)
        if live is None:
            del variables[name]
        else:
            variables[name] = (v[0], live, v[2], exps)
            soonest.append(min(left))
    return min(soonest, default=None)


def _expiries(exps) -> list:
    """A variable's expiries: the value's, its list elements', its map keys'."""
    if isinstance(exps, dict):
        return list(exps.values())
    return exps if isinstance(exps, list) else [exps]


def _alive(value, exps, now: int):
    """``(value, expiries)`` of what has not expired (``(None, None)`` if nothing)."""
    if isinstance(exps, dict):  # (a map: an expiry per key)
        live = {a: b for a, b in value.items() if exps.get(a, 0) > now}
        return (live, {a: exps[a] for a in live}) if live else (None, None)
    if isinstance(exps, list):  # (a list: an expiry per element)
        keep = [i for i, e in enumerate(exps) if e > now]
        return ([value[i] for i in keep], [exps[i] for i in keep]) if keep else (None, None)
    return (value, exps) if exps > now else (None, None)


class _Variable:
    """A state variable of the key being called. A key's entry keeps each variable as
    ``(batch written, value, schema numbers)``; a variable dropped (``deleteIfExists``) in
    batch N has no value written before N, for any key, without touching them; a value written
    with another schema of the variable is read in the current one (:meth:`Codec.evolve`)."""

    KIND = "value"

    def __init__(self, handle: "StoreHandle", name: str, ttl: Optional[int] = None):
        self._h, self._name, self._ttl = handle, name, ttl
        self._token = handle._live[name] = object()

    def _key(self, what: str) -> KeyState:
        if self._h._live.get(self._name) is not self._token:
            raise PySparkRuntimeError(
                f"Error {what}: [STATE_STORE_UNSUPPORTED_OPERATION_ON_MISSING_COLUMN_FAMILY] "
                f"state variable {self._name!r} was removed (deleteIfExists)")
        return self._h._key()

    def _read(self, what: str):
        """``(key state, value, expiries)``: the variable's value (None if none) and, if
        written with a TTL, the expiries of what has not expired (values expired in this
        batch's time are not seen, as natively, before the batch's end drops them)."""
        k = self._key(what)
        v = k.vars.get(self._name)
        if v is None or v[0] < self._h._inst.dropped.get(self._name, -1):
            return k, None, None
        value = v[1] if v[2] == self._sids() else self._evolve(v[1], v[2])
        if len(v) > 3:
            return (k, *_alive(value, v[3], self._h._inst.ts_ms))
        return k, value, None

    def _expiry(self) -> int:
        """The expiry of what is written now (Spark: the batch's timestamp plus the TTL)."""
        return self._h._inst.ts_ms + self._ttl

    def _write(self, k: KeyState, value, exps=None) -> None:
        if value is None:
            if k.vars.pop(self._name, None) is None:
                return
        else:
            v = (self._h._inst.batch_no, value, self._sids())
            k.vars[self._name] = v if self._ttl is None else v + (exps,)
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
    def __init__(self, handle: "StoreHandle", name: str, codec: Codec, ttl=None):
        super().__init__(handle, name, ttl)
        self._codec = codec

    def get(self) -> Optional[tuple]:
        v = self._read("getting value state")[1]
        return None if v is None else self._codec.from_store(v)

    def update(self, newValue: tuple) -> None:
        k = self._key("updating value state")
        self._write(k, self._codec.to_store(newValue), self._ttl and self._expiry())


class _List(_Variable, ListState):
    KIND = "list"

    def __init__(self, handle: "StoreHandle", name: str, codec: Codec, ttl=None):
        super().__init__(handle, name, ttl)
        self._codec = codec

    def _evolve(self, value, sids: tuple):
        return [self._codec.evolve(v, sids[0]) for v in value]

    def _expiries(self, n: int, old=None, had: int = 0) -> Optional[list]:
        """Expiries of a list of ``had`` kept elements (``old``: theirs) and ``n`` new ones."""
        if self._ttl is None:
            return None
        e = self._expiry()
        return (list(old) if old is not None else [e] * had) + [e] * n

    def get(self) -> Iterator[tuple]:
        items = self._read("getting list state")[1] or ()
        return iter([self._codec.from_store(v) for v in items])

    def put(self, newState: List[tuple]) -> None:
        k = self._key("putting list state")
        items = [self._codec.to_store(v) for v in newState]
        self._write(k, items or None, self._expiries(len(items)))

    def appendValue(self, newState: tuple) -> None:  # noqa: N802
        self.appendList([newState])

    def appendList(self, newState: List[tuple]) -> None:  # noqa: N802
        k, old, exps = self._read("appending list state")
        items = [self._codec.to_store(v) for v in newState]
        if items:
            old = list(old or ())
            self._write(k, old + items, self._expiries(len(items), exps, len(old)))


class _Map(_Variable, MapState):
    KIND = "map"

    def __init__(self, handle: "StoreHandle", name: str, keys: Codec, values: Codec,
                 ttl=None):
        super().__init__(handle, name, ttl)
        self._keys, self._values = keys, values

    def _sids(self) -> tuple:
        return (self._keys.sid, self._values.sid)

    def _evolve(self, value, sids: tuple):
        return {self._keys.evolve(a, sids[0]): self._values.evolve(b, sids[1])
                for a, b in value.items()}

    def _map(self, what: str):
        k, m, exps = self._read(what)
        return k, m or {}, exps or {}

    def _with(self, m: dict, exps: dict, changed=None) -> Optional[dict]:
        """The map's expiries after a change of key ``changed`` (None without a TTL)."""
        if self._ttl is None:
            return None
        e = self._expiry()
        return {a: (e if a == changed else exps.get(a, e)) for a in m}

    def getValue(self, key: tuple) -> Optional[tuple]:  # noqa: N802
        v = self._map("getting map state value")[1].get(self._keys.to_store(key))
        return None if v is None else self._values.from_store(v)

    def containsKey(self, key: tuple) -> bool:  # noqa: N802
        return self._keys.to_store(key) in self._map("checking map state key")[1]

    def updateValue(self, key: tuple, value: tuple) -> None:  # noqa: N802
        k, m, exps = self._map("updating map state value")
        m = dict(m)
        ks = self._keys.to_store(key)
        m[ks] = self._values.to_store(value)
        self._write(k, m, self._with(m, exps, ks))

    def iterator(self) -> Iterator[tuple]:
        return iter([(self._keys.from_store(a), self._values.from_store(b))
                     for a, b in self._map("iterating map state")[1].items()])

    def keys(self) -> Iterator[tuple]:
        return iter([self._keys.from_store(a) for a in self._map("getting map state keys")[1]])

    def values(self) -> Iterator[tuple]:
        return iter([self._values.from_store(b)
                     for b in self._map("getting map state values")[1].values()])

    def removeKey(self, key: tuple) -> None:  # noqa: N802
        k, m, exps = self._map("removing map state key")
        ks = self._keys.to_store(key)
        if ks in m:
            m = dict(m)
            del m[ks]
            self._write(k, m or None, self._with(m, exps))


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

    def _ttl(self, stateName: str, ttl: Optional[int]) -> Optional[int]:
        """A variable's TTL in ms (None: none), checked as Spark checks it."""
        if ttl is None:
            return None
        if self._time_mode != "processingtime":
            raise PySparkRuntimeError(
                "[STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL] Cannot use TTL for "
                f"state={stateName} in timeMode={self._inst.time_mode}, use "
                "TimeMode.ProcessingTime() instead.")
        if int(ttl) <= 0:
            raise PySparkRuntimeError(
                "[STATEFUL_PROCESSOR_TTL_DURATION_MUST_BE_POSITIVE] TTL duration must be "
                f"greater than zero for State store operation=update on state={stateName}.")
        self._inst.uses_ttl = True
        return int(ttl)

    def _declared(self, kind: str, ttl: Optional[int]) -> Optional[int]:
        self._inst.count(f"num{kind}StateVars" if ttl is None else f"num{kind}StateWithTTLVars")
        return ttl

    def getValueState(self, stateName: str, schema, ttlDurationMs: Optional[int] = None
                      ) -> ValueState:
        codec = self._codec(schema)
        self._inst.declare(stateName, codec.schema)
        return _Value(self, stateName, codec,
                      self._declared("Value", self._ttl(stateName, ttlDurationMs)))

    def getListState(self, stateName: str, schema, ttlDurationMs: Optional[int] = None
                     ) -> ListState:
        codec = self._codec(schema)
        self._inst.declare(stateName, codec.schema)
        return _List(self, stateName, codec,
                     self._declared("List", self._ttl(stateName, ttlDurationMs)))

    def getMapState(self, stateName: str, userKeySchema, valueSchema,
                    ttlDurationMs: Optional[int] = None) -> MapState:
        values = self._codec(valueSchema)
        self._inst.declare(stateName, values.schema)
        return _Map(self, stateName, self._codec(userKeySchema), values,
                    self._declared("Map", self._ttl(stateName, ttlDurationMs)))

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
        if t >= TTL_TIMERS:
            raise PySparkRuntimeError(f"a timer at {t} ms is beyond the timers the engine keeps "
                                      f"(below {TTL_TIMERS} ms)")
        self._inst.count("numRegisteredTimers")
        if t not in k.timers:
            k.timers.add(t)
            k.changed = True

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("deleteTimer")
        k = self._key()
        t = int(expiryTimestampMs)
        self._inst.count("numDeletedTimers")
        if t in k.timers:
            k.timers.discard(t)
            k.changed = True

    def listTimers(self) -> Iterator[int]:
        self._check_timers("listTimers")
        return iter(sorted(self._key().timers))

    def deleteIfExists(self, stateName: str) -> None:
        if self._live.pop(stateName, None) is not None:
            self._inst.count("numDeletedStateVars")
        self._inst.drop(stateName)
