"""The checks Spark makes of a transformWithState query's state schemas across restarts
(``StateSchemaCompatibilityChecker``), for the drop-in's instances: with Avro encoding
(``spark.sql.streaming.stateStore.encodingFormat=avro``) a value schema may evolve as Avro allows
(fields added, removed, reordered, widened: int to long, float or double, long to float or
double, float to double, string to and from binary) and its fields must be nullable; with the
default UnsafeRow encoding it must keep its fields' number and types. What Spark refuses fails
the query with Spark's error class and message.

Examples
--------
>>> from pyspark.sql.types import IntegerType, LongType, StructField, StructType
>>> old = StructType([StructField("id", LongType())])
>>> check_evolution("state", old, StructType([StructField("id", LongType()),
...                                           StructField("n", IntegerType())]), avro=True)
>>> check_evolution("state", old, StructType([StructField("id", IntegerType())]),
...                 avro=True)  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
pyspark.errors.exceptions.base.PySparkRuntimeError: [STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION] Schema evolution is not possible new value_schema=StructType(StructField(id,IntegerType,true)) and old value_schema=StructType(StructField(id,LongType,true)) ...
"""

from __future__ import annotations

from pyspark.errors import PySparkRuntimeError
from pyspark.sql.types import ArrayType, DataType, DecimalType, MapType, StructType

__all__ = ["check_evolution", "check_nullable", "scala_string"]

# (from, to) type changes Avro's schema resolution allows
_WIDENINGS = {("IntegerType", "LongType"), ("IntegerType", "FloatType"),
              ("IntegerType", "DoubleType"), ("LongType", "FloatType"),
              ("LongType", "DoubleType"), ("FloatType", "DoubleType"),
              ("StringType", "BinaryType"), ("BinaryType", "StringType")}


def scala_string(dt: DataType) -> str:
    """``dt`` as Spark's Scala ``toString`` prints it (the text of Spark's messages)."""
    if isinstance(dt, StructType):
        return "StructType(" + ",".join(
            f"StructField({f.name},{scala_string(f.dataType)},{str(f.nullable).lower()})"
            for f in dt.fields) + ")"
    if isinstance(dt, ArrayType):
        return f"ArrayType({scala_string(dt.elementType)},{str(dt.containsNull).lower()})"
    if isinstance(dt, MapType):
        return (f"MapType({scala_string(dt.keyType)},{scala_string(dt.valueType)},"
                f"{str(dt.valueContainsNull).lower()})")
    if isinstance(dt, DecimalType):
        return f"DecimalType({dt.precision},{dt.scale})"
    return type(dt).__name__


def _all_nullable(dt: DataType) -> bool:
    if isinstance(dt, StructType):
        return all(f.nullable and _all_nullable(f.dataType) for f in dt.fields)
    return True


def check_nullable(name: str, schema: StructType) -> None:
    """Avro encoding: every field of a state schema nullable (Spark's
    ``TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE``)."""
    if not _all_nullable(schema):
        raise PySparkRuntimeError(
            "[TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE] If Avro encoding is enabled, all the "
            f"fields in the schema for column family {name} must be nullable when using the "
            "TransformWithState operator. Please make the schema nullable. Current schema: "
            f"{scala_string(schema)}")


def _same_shape(a: DataType, b: DataType) -> bool:
    """Equal but for field names and nullability (UnsafeRow: positions and types)."""
    if isinstance(a, StructType) and isinstance(b, StructType):
        return len(a.fields) == len(b.fields) and all(
            _same_shape(x.dataType, y.dataType) for x, y in zip(a.fields, b.fields))
    if isinstance(a, ArrayType) and isinstance(b, ArrayType):
        return _same_shape(a.elementType, b.elementType)
    if isinstance(a, MapType) and isinstance(b, MapType):
        return _same_shape(a.keyType, b.keyType) and _same_shape(a.valueType, b.valueType)
    return a == b


def check_evolution(name: str, old: StructType, new: StructType, avro: bool) -> None:
    """A state variable's value schema ``old`` (its checkpoint's) followed by ``new``, as Spark
    allows it, or Spark's error."""
    if not avro:
        if not _same_shape(old, new):
            raise PySparkRuntimeError(
                "[STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE] Provided value schema does not match "
                "existing state value schema. Please check number and type of fields. Existing "
                f"value_schema={scala_string(old)} and new value_schema={scala_string(new)}. "
                "(state variable " + repr(name) + ")")
        return
    before = {f.name: f.dataType for f in old.fields}
    for f in new.fields:
        was = before.get(f.name)
        if was is None or was == f.dataType:
            continue
        if (type(was).__name__, type(f.dataType).__name__) not in _WIDENINGS:
            raise PySparkRuntimeError(
                "[STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION] Schema evolution is not possible "
                f"new value_schema={scala_string(new)} and old value_schema={scala_string(old)}"
                " Please check https://avro.apache.org/docs/1.11.1/specification/_print/"
                "#schema-resolution for valid schema evolution.")
