package org.apache.spark.sql.stretch

import org.apache.arrow.memory.ArrowBuf
import org.apache.arrow.vector.{BaseFixedWidthVector, BaseVariableWidthVector, BigIntVector, BitVector, BitVectorHelper, DateDayVector, Float4Vector, Float8Vector, IntVector, SmallIntVector, TimeStampMicroTZVector, TimeStampMicroVector, TinyIntVector, ValueVector, VarCharVector}
import org.apache.arrow.vector.complex.ListVector

import org.apache.spark.sql.catalyst.expressions.SpecializedGetters
import org.apache.spark.unsafe.Platform

/**
 * Appends values to one Arrow vector a column at a time, for the columnar ingest
 * ([[StretchIngest]]): a scan's column (as a `ColumnarArray` over its `ColumnVector`) or the
 * elements of an array go straight into the vector's buffers, with none of the per-row,
 * per-field dispatch of Spark's `ArrowWriter`. The values are those `ArrowWriter` writes for the
 * same Spark types (the vectors are the ones it creates); other vector types have no copier and
 * the ingest falls back to `ArrowWriter`.
 */
private[stretch] abstract class ColumnCopier {
  protected var count = 0

  /** Appends `src(0 until n)` after the values appended since the last [[reset]]. */
  def append(src: SpecializedGetters, n: Int): Unit

  /** Sets the vector's value count (before the batch is written). */
  def finish(): Unit

  /** Empties the vector for the next batch (its buffers are kept). */
  def reset(): Unit
}

private[stretch] object ColumnCopier {
  /** A copier for `v`, or None if its type has none. */
  def apply(v: ValueVector): Option[ColumnCopier] = v match {
    case x: BigIntVector => Some(new LongCopier(x))
    case x: TimeStampMicroTZVector => Some(new LongCopier(x))
    case x: TimeStampMicroVector => Some(new LongCopier(x))
    case x: IntVector => Some(new IntCopier(x))
    case x: DateDayVector => Some(new IntCopier(x))
    case x: SmallIntVector => Some(new FixedCopier(x) {
      def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit = d.setShort(i * 2L, s.getShort(j))
    })
    case x: TinyIntVector => Some(new FixedCopier(x) {
      def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit = d.setByte(i.toLong, s.getByte(j))
    })
    case x: Float8Vector => Some(new FixedCopier(x) {
      def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit = d.setDouble(i * 8L, s.getDouble(j))
    })
    case x: Float4Vector => Some(new FixedCopier(x) {
      def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit = d.setFloat(i * 4L, s.getFloat(j))
    })
    case x: BitVector => Some(new FixedCopier(x) {
      def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit =
        if (s.getBoolean(j)) BitVectorHelper.setBit(d, i.toLong)
    })
    case x: VarCharVector => Some(new StringCopier(x))
    case x: ListVector => ColumnCopier(x.getDataVector).map(new ListCopier(x, _))
    case _ => None
  }
}

/** Fixed-width values: the validity bit and `put` of each non-null value. */
private abstract class FixedCopier(vec: BaseFixedWidthVector) extends ColumnCopier {
  def put(data: ArrowBuf, index: Int, src: SpecializedGetters, ordinal: Int): Unit

  override def append(src: SpecializedGetters, n: Int): Unit = {
    while (vec.getValueCapacity < count + n) vec.reAlloc()  // new room comes zeroed: null
    val data = vec.getDataBuffer
    val valid = vec.getValidityBuffer
    var j = 0
    while (j < n) {
      if (!src.isNullAt(j)) {
        BitVectorHelper.setBit(valid, (count + j).toLong)
        put(data, count + j, src, j)
      }
      j += 1
    }
    count += n
  }

  override def finish(): Unit = vec.setValueCount(count)

  override def reset(): Unit = {
    vec.reset()
    count = 0
  }
}

private final class LongCopier(vec: BaseFixedWidthVector) extends FixedCopier(vec) {
  def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit = d.setLong(i * 8L, s.getLong(j))
}

private final class IntCopier(vec: BaseFixedWidthVector) extends FixedCopier(vec) {
  def put(d: ArrowBuf, i: Int, s: SpecializedGetters, j: Int): Unit = d.setInt(i * 4L, s.getInt(j))
}

/** UTF-8 strings: bytes copied from where the column keeps them, offsets written as we go. */
private final class StringCopier(vec: BaseVariableWidthVector) extends ColumnCopier {
  override def append(src: SpecializedGetters, n: Int): Unit = {
    while (vec.getValueCapacity < count + n) vec.reallocValidityAndOffsetBuffers()
    val offsets = vec.getOffsetBuffer
    val valid = vec.getValidityBuffer
    var end = offsets.getInt(count * 4L)
    var data = vec.getDataBuffer
    var j = 0
    while (j < n) {
      val idx = count + j
      if (!src.isNullAt(j)) {
        val s = src.getUTF8String(j)
        val len = s.numBytes
        while (data.capacity < end.toLong + len) {
          vec.reallocDataBuffer()
          data = vec.getDataBuffer
        }
        Platform.copyMemory(s.getBaseObject, s.getBaseOffset, null, data.memoryAddress + end, len)
        end += len
        BitVectorHelper.setBit(valid, idx.toLong)
      }
      offsets.setInt((idx + 1) * 4L, end)
      j += 1
    }
    count += n
    vec.setLastSet(count - 1)
  }

  override def finish(): Unit = vec.setValueCount(count)

  override def reset(): Unit = {
    vec.reset()
    count = 0
  }
}

/** Arrays: each row's elements appended to the child vector by its own copier. */
private final class ListCopier(vec: ListVector, child: ColumnCopier) extends ColumnCopier {
  override def append(src: SpecializedGetters, n: Int): Unit = {
    while (vec.getValueCapacity < count + n) vec.reAlloc()
    val offsets = vec.getOffsetBuffer
    val valid = vec.getValidityBuffer
    var end = offsets.getInt(count * 4L)
    var j = 0
    while (j < n) {
      val idx = count + j
      if (!src.isNullAt(j)) {
        val arr = src.getArray(j)
        val m = arr.numElements
        child.append(arr, m)
        end += m
        BitVectorHelper.setBit(valid, idx.toLong)
      }
      offsets.setInt((idx + 1) * 4L, end)
      j += 1
    }
    count += n
    vec.setLastSet(count - 1)
  }

  override def finish(): Unit = {
    child.finish()
    vec.setValueCount(count)
  }

  override def reset(): Unit = {
    vec.reset()
    child.reset()
    count = 0
  }
}
