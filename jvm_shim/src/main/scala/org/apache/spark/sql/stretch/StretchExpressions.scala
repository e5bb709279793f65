package org.apache.spark.sql.stretch

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.catalyst.expressions.codegen.CodegenFallback
import org.apache.spark.sql.catalyst.util.HyperLogLogPlusPlusHelper
import org.apache.spark.sql.types._

/** Several grouping columns as one key: their unsafe row's bytes (Spark's own grouping key). */
case class StretchKeyEncode(children: Seq[Expression]) extends Expression with CodegenFallback {
  override def nullable: Boolean = false
  override def dataType: DataType = BinaryType
  @transient private lazy val proj = UnsafeProjection.create(children)
  override def eval(input: InternalRow): Any = proj(input).getBytes
  override protected def withNewChildrenInternal(c: IndexedSeq[Expression]): Expression =
    copy(children = c)
}

/** The grouping columns of a key made by [[StretchKeyEncode]]. */
case class StretchKeyDecode(child: Expression, schema: StructType)
  extends UnaryExpression with CodegenFallback {
  override def dataType: DataType = schema
  override protected def nullSafeEval(v: Any): Any = {
    val bytes = v.asInstanceOf[Array[Byte]]
    val row = new UnsafeRow(schema.length)
    row.pointTo(bytes, bytes.length)
    row
  }
  override protected def withNewChildInternal(c: Expression): Expression = copy(child = c)
}

/** An exact decimal sum from the sums of its unscaled values' high and low 32 bits, as a
 * decimal of `dataType` (null when it needs more digits: Spark's sum overflowed). */
case class StretchDecimalSum(hi: Expression, lo: Expression, dataType: DecimalType)
  extends BinaryExpression with CodegenFallback {
  override def left: Expression = hi
  override def right: Expression = lo
  override def nullable: Boolean = true
  override protected def nullSafeEval(h: Any, l: Any): Any = {
    val u = java.math.BigInteger.valueOf(h.asInstanceOf[Long]).shiftLeft(32)
      .add(java.math.BigInteger.valueOf(l.asInstanceOf[Long]))
    val d = Decimal(new java.math.BigDecimal(u, dataType.scale))
    if (d.changePrecision(dataType.precision, dataType.scale)) d else null
  }
  override protected def withNewChildrenInternal(l: Expression, r: Expression): Expression =
    copy(hi = l, lo = r)
}

/** Spark's `approx_count_distinct` of HLL++ register words the engine kept (Spark's own buffer
 * of `HyperLogLogPlusPlus`, updated as Spark updates it; as one binary value, the words as
 * little-endian longs): Spark's own estimate from them. */
case class StretchHll(child: Expression, relativeSD: Double)
  extends UnaryExpression with CodegenFallback {
  @transient private lazy val helper = new HyperLogLogPlusPlusHelper(relativeSD)
  override def nullable: Boolean = false
  override def dataType: DataType = LongType
  override def eval(input: InternalRow): Any = {
    val bytes = java.nio.ByteBuffer.wrap(child.eval(input).asInstanceOf[Array[Byte]])
      .order(java.nio.ByteOrder.LITTLE_ENDIAN)
    val words = new Array[Any](helper.numWords)
    for (w <- words.indices) words(w) = bytes.getLong(8 * w)
    helper.query(new GenericInternalRow(words), 0)
  }
  override protected def withNewChildInternal(c: Expression): Expression = copy(child = c)
}

/** An opaque value of a stretch aggregation `id`'s plan that Spark's optimizer keeps (not
 * foldable): `true` in the filter that makes a chain the aggregation's own, null in the stub of
 * an aggregation's columns. Never evaluated where it matters: the chain never runs. */
case class StretchTag(id: String, dataType: DataType = BooleanType)
  extends LeafExpression with CodegenFallback {
  override def nullable: Boolean = dataType != BooleanType
  override def eval(input: InternalRow): Any = if (dataType == BooleanType) true else null
}

/** A double's IEEE bits as a long, and back (`StretchBitsDouble`): a floating-point value kept
 * in the engine's int slot (`max_by`/`min_by` of doubles). */
case class StretchDoubleBits(child: Expression) extends UnaryExpression with CodegenFallback {
  override def dataType: DataType = LongType
  override protected def nullSafeEval(v: Any): Any =
    java.lang.Double.doubleToRawLongBits(v.asInstanceOf[Double])
  override protected def withNewChildInternal(c: Expression): Expression = copy(child = c)
}

/** A double as a long that orders as Spark orders doubles (`SQLOrderingUtil.compareDoubles`):
 * -0.0 as 0.0, every NaN as one, greater than +Infinity; the IEEE bits with a negative number's
 * other bits flipped. The key of a `max_by`/`min_by` ordered by a floating-point column. */
case class StretchDoubleOrder(child: Expression) extends UnaryExpression with CodegenFallback {
  override def dataType: DataType = LongType
  override protected def nullSafeEval(v: Any): Any = {
    val d = v.asInstanceOf[Double]
    val b = java.lang.Double.doubleToLongBits(if (d == 0.0) 0.0 else d)
    b ^ ((b >> 63) & Long.MaxValue)
  }
  override protected def withNewChildInternal(c: Expression): Expression = copy(child = c)
}

case class StretchBitsDouble(child: Expression) extends UnaryExpression with CodegenFallback {
  override def dataType: DataType = DoubleType
  override protected def nullSafeEval(v: Any): Any =
    java.lang.Double.longBitsToDouble(v.asInstanceOf[Long])
  override protected def withNewChildInternal(c: Expression): Expression = copy(child = c)
}
