package org.apache.spark.sql.stretch

import scala.jdk.CollectionConverters._

import org.apache.arrow.vector.ipc.ArrowStreamReader

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.read.{Batch, InputPartition, PartitionReader, PartitionReaderFactory, Scan, ScanBuilder}
import org.apache.spark.sql.types.StructType
import org.apache.spark.sql.util.ArrowUtils
import org.apache.spark.sql.vectorized.{ArrowColumnVector, ColumnarBatch, ColumnVector}

class StretchScanBuilder(schema: StructType, opts: StretchOptions) extends ScanBuilder {
  override def build(): Scan = new Scan with Batch {
    override def readSchema(): StructType = schema
    override def toBatch: Batch = this
    override def description(): String = s"stretch[${opts.stream}]"
    override def planInputPartitions(): Array[InputPartition] =
      StretchInputPartition.all(opts).map(p => p: InputPartition)
    override def createReaderFactory(): PartitionReaderFactory = StretchReaderFactory(schema, opts)
  }
}

object StretchInputPartition {
  /** `splits` partitions per host receiver, placed on that host so rows never leave it. */
  def all(opts: StretchOptions): Array[StretchInputPartition] =
    opts.endpoints.zipWithIndex.flatMap { case ((host, path), i) =>
      (0 until opts.splits).map(j => StretchInputPartition(i * opts.splits + j, host, path, j,
        opts.splits))
    }.toArray
}

case class StretchInputPartition(
    index: Int, host: String, endpoint: String, split: Int = 0, splits: Int = 1)
  extends InputPartition {
  override def preferredLocations(): Array[String] =
    if (host == "*" || host.isEmpty) Array.empty else Array(host)
}

case class StretchReaderFactory(schema: StructType, opts: StretchOptions)
  extends PartitionReaderFactory {
  override def supportColumnarReads(partition: InputPartition): Boolean = true

  override def createReader(partition: InputPartition): PartitionReader[InternalRow] = {
    val columnar = createColumnarReader(partition)
    new PartitionReader[InternalRow] {
      private var rows: java.util.Iterator[InternalRow] = java.util.Collections.emptyIterator()
      override def next(): Boolean = {
        while (!rows.hasNext && columnar.next()) rows = columnar.get().rowIterator()
        rows.hasNext
      }
      override def get(): InternalRow = rows.next()
      override def close(): Unit = columnar.close()
    }
  }

  /** Streams the receiver's Arrow batches straight into Spark's columnar batches, no row copy. */
  override def createColumnarReader(partition: InputPartition): PartitionReader[ColumnarBatch] = {
    val p = partition.asInstanceOf[StretchInputPartition]
    new PartitionReader[ColumnarBatch] {
      private val client = opts.client((p.host, p.endpoint))
      client.request({
        val h = ReceiverClient.header("read", opts.stream)
        h.put("partition", p.index)
        h.put("split", p.split)
        h.put("splits", p.splits)
        h
      })
      private val allocator =
        ArrowUtils.rootAllocator.newChildAllocator(s"stretch-read-${p.index}", 0, Long.MaxValue)
      private val reader = new ArrowStreamReader(client.in, allocator)
      private val root = reader.getVectorSchemaRoot
      private val got = ArrowUtils.fromArrowSchema(root.getSchema)
      if (got.fields.map(_.name).toSeq != schema.fields.map(_.name).toSeq) {
        close()
        throw new IllegalStateException(s"stretch stream '${opts.stream}' offers columns " +
          s"${got.fields.map(_.name).mkString("[", ", ", "]")} but the read expects " +
          s"${schema.fields.map(_.name).mkString("[", ", ", "]")}")
      }
      private var batch: ColumnarBatch = null

      // Spark may free a batch's vectors once consumed (closeIfFreeable), and closing an Arrow
      // struct vector drops its children: so each batch gets its own vectors, moved (zero-copy)
      // out of the reader's root, and the previous batch is released when the next is loaded.
      private def release(): Unit = if (batch != null) { batch.close(); batch = null }

      override def next(): Boolean = {
        release()
        if (!reader.loadNextBatch()) return false
        val vectors = root.getFieldVectors.asScala.map { v =>
          val tp = v.getTransferPair(allocator)
          tp.transfer()
          new ArrowColumnVector(tp.getTo): ColumnVector
        }.toArray
        batch = new ColumnarBatch(vectors, root.getRowCount)
        true
      }
      override def get(): ColumnarBatch = batch
      override def close(): Unit = {
        try release() finally try reader.close() finally try allocator.close() finally client.close()
      }
    }
  }
}
