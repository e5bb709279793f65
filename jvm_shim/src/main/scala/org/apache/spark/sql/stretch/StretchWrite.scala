package org.apache.spark.sql.stretch

import java.io.IOException

import scala.jdk.CollectionConverters._

import org.apache.arrow.compression.CommonsCompressionFactory
import org.apache.arrow.vector.compression.CompressionUtil
import org.apache.arrow.vector.ipc.ArrowStreamWriter
import org.apache.arrow.vector.ipc.message.IpcOption

import org.apache.spark.TaskContext
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.write.{BatchWrite, DataWriter, DataWriterFactory, PhysicalWriteInfo, Write, WriteBuilder, WriterCommitMessage}
import org.apache.spark.sql.execution.arrow.ArrowWriter
import org.apache.spark.sql.internal.SQLConf
import org.apache.spark.sql.types.StructType
import org.apache.spark.sql.vectorized.{ColumnVector, ColumnarArray, ColumnarBatch}

class StretchWriteBuilder(schema: StructType, opts: StretchOptions, queryId: String)
  extends WriteBuilder {
  override def build(): Write = new Write {
    override def toBatch: BatchWrite = new StretchBatchWrite(schema, opts, queryId)
  }
}

/** What a task reports on commit: where its rows went and under which attempt (one per endpoint
 * it wrote to). */
case class StretchCommitMessage(endpoint: String, partition: Int, taskId: Long, rows: Long)
  extends WriterCommitMessage

/** A routed task's commit: one message per endpoint its rows went to. */
case class StretchCommitMessages(parts: Seq[StretchCommitMessage]) extends WriterCommitMessage

/**
 * Two-phase write: tasks stage their Arrow batches at the receiver under (job, partition, task);
 * the driver's commit publishes exactly the attempts Spark committed, so a retried or speculative
 * task never delivers twice, and an aborted job delivers nothing.
 */
class StretchBatchWrite(schema: StructType, opts: StretchOptions, queryId: String)
  extends BatchWrite {
  private val job = s"$queryId-${java.util.UUID.randomUUID()}"

  override def createBatchWriterFactory(info: PhysicalWriteInfo): DataWriterFactory =
    StretchDataWriterFactory(schema, opts, job, SQLConf.get.sessionLocalTimeZone)

  override def useCommitCoordinator(): Boolean = true

  override def commit(messages: Array[WriterCommitMessage]): Unit =
    StretchBatchWrite.commit(opts, job, messages.toSeq.flatMap {
      case m: StretchCommitMessage => Seq(m)
      case StretchCommitMessages(parts) => parts
      case _ => Nil
    })

  override def abort(messages: Array[WriterCommitMessage]): Unit = StretchBatchWrite.abort(opts, job)
}

object StretchBatchWrite {
  /** Publishes exactly the attempts in `msgs` (one per partition) at every endpoint. */
  def commit(opts: StretchOptions, job: String, msgs: Seq[StretchCommitMessage]): Unit = {
    // Every endpoint hears the commit, also those that got no rows, so each sees every job end.
    val byEndpoint = msgs.groupBy(_.endpoint)
    (opts.endpoints.map(_._2).toSet ++ byEndpoint.keySet).foreach { endpoint =>
      val client = opts.client((opts.endpoints.find(_._2 == endpoint).map(_._1).getOrElse(""),
        endpoint))
      try {
        val h = ReceiverClient.header("commit", opts.stream)
        h.put("job", job)
        val arr = h.putArray("attempts")
        byEndpoint.getOrElse(endpoint, Seq.empty[StretchCommitMessage]).sortBy(_.partition)
          .foreach { m => arr.addArray().add(m.partition).add(m.taskId) }
        client.request(h)
      } finally client.close()
    }
  }

  /** Drops whatever the job staged at every endpoint (best effort). */
  def abort(opts: StretchOptions, job: String): Unit = {
    opts.endpoints.distinct.foreach { entry =>
      try {
        val client = opts.client(entry)
        try {
          val h = ReceiverClient.header("abort", opts.stream)
          h.put("job", job)
          client.request(h)
        } finally client.close()
      } catch { case _: IOException => () } // a dead receiver has nothing staged to drop
    }
  }
}

case class StretchDataWriterFactory(
    schema: StructType, opts: StretchOptions, job: String, timeZoneId: String)
  extends DataWriterFactory {
  override def createWriter(partitionId: Int, taskId: Long): DataWriter[InternalRow] =
    new StretchDataWriter(schema, opts, job, timeZoneId, partitionId, taskId)
}

/** Converts rows to Arrow in the JVM (Spark's own ArrowWriter) and streams batches to the host. */
class StretchDataWriter(
    schema: StructType, opts: StretchOptions, job: String, timeZoneId: String,
    partitionId: Int, taskId: Long) extends DataWriter[InternalRow] {

  // Routed (a query on several hosts): the row goes to each host its last column lists, as
  // the rows of the schema without that column; else to this executor's host.
  private val routed = opts.route != null
  private val rowSchema = if (routed) StructType(schema.fields.dropRight(1)) else schema
  private val outs = new Array[TaskStream](if (routed) opts.endpoints.size else 1)
  private val routeAt = schema.fields.length - 1
  if (routed && schema.fields.last.name != opts.route) {
    throw new IllegalArgumentException(s"The option '${StretchOptions.ROUTE}' names " +
      s"'${opts.route}', but the last column is '${schema.fields.last.name}'")
  }

  private def out(i: Int): TaskStream = {
    if (outs(i) == null) {
      outs(i) = new TaskStream(rowSchema, opts, job, timeZoneId, partitionId, taskId,
        if (routed) opts.endpoints(i) else opts.entryFor(StretchOptions.hostOf()))
    }
    outs(i)
  }

  override def write(row: InternalRow): Unit = if (!routed) out(0).write(row) else {
    val hosts = row.getArray(routeAt)
    var k = 0
    while (k < hosts.numElements()) {
      out(hosts.getInt(k)).write(row)  // (ArrowWriter reads the fields of rowSchema only)
      k += 1
    }
  }

  override def commit(): WriterCommitMessage =
    if (!routed) out(0).commit()
    else StretchCommitMessages(outs.toSeq.filter(_ != null).map(_.commit()))

  override def abort(): Unit = close()

  override def close(): Unit = outs.foreach(o => if (o != null) o.close())
}

/**
 * One task attempt's rows on their way to the receiver of its host: converted to Arrow by Spark's
 * own `ArrowWriter` and streamed as IPC batches of `batchRows` rows; staged there under
 * (job, partition, task) until the driver commits the job.
 */
class TaskStream(
    schema: StructType, opts: StretchOptions, job: String, timeZoneId: String,
    partitionId: Int, taskId: Long, entry: (String, String)) {

  def this(schema: StructType, opts: StretchOptions, job: String, timeZoneId: String,
           partitionId: Int, taskId: Long) =
    this(schema, opts, job, timeZoneId, partitionId, taskId, opts.entryFor(StretchOptions.hostOf()))

  private val endpoint = entry._2
  private val client = opts.client(entry)
  private val arrow = ArrowWriter.create(schema, timeZoneId, true, false)
  // To another host (TCP), the batches' buffers are ZSTD-compressed (pyarrow reads them as
  // they come): the bytes between hosts, not this host's Unix socket, are what is scarce.
  // and their array<string> columns dictionary-encoded batch by batch (DictionaryLists).
  private val tcp = opts.address(entry).startsWith("tcp://")
  private val dicts = if (!tcp) None else {
    val d = new DictionaryLists(arrow.root,
      arrow.root.getFieldVectors.asScala.headOption.map(_.getAllocator).orNull)
    if (d.active) Some(d) else { d.close(); None }
  }
  private val stream = if (!tcp) {
    new ArrowStreamWriter(arrow.root, null, client.out)
  } else {
    new ArrowStreamWriter(dicts.map(_.root).getOrElse(arrow.root), dicts.map(_.provider).orNull,
      java.nio.channels.Channels.newChannel(client.out), IpcOption.DEFAULT,
      CommonsCompressionFactory.INSTANCE, CompressionUtil.CodecType.ZSTD)
  }
  private var inBatch = 0
  private var rows = 0L
  private var open = true

  {
    val h = ReceiverClient.header("write", opts.stream)
    h.put("job", job)
    h.put("partition", partitionId)
    h.put("task", taskId)
    val ctx = TaskContext.get()
    h.put("attempt", if (ctx == null) 0 else ctx.attemptNumber())
    client.send(h)
    stream.start()
  }

  // Column by column into the same vectors, when every column's type has a copier.
  private lazy val copiers: Option[Array[ColumnCopier]] = {
    val cs = arrow.root.getFieldVectors.asScala.map(ColumnCopier(_))
    if (cs.forall(_.isDefined)) Some(cs.map(_.get).toArray) else None
  }
  private var columnar = false

  private def flushBatch(): Unit = if (inBatch > 0) {
    if (columnar) {
      copiers.get.foreach(_.finish())
      arrow.root.setRowCount(inBatch)
      dicts.foreach(_.encode())
      stream.writeBatch()
      copiers.get.foreach(_.reset())
    } else {
      arrow.finish()
      dicts.foreach(_.encode())
      stream.writeBatch()
      arrow.reset()
    }
    inBatch = 0
  }

  /** Appends `n` rows given as columns (one per field of the schema, in order). */
  def writeColumns(cols: Array[ColumnVector], n: Int): Unit = copiers match {
    case Some(cs) if columnar || rows == 0 =>
      columnar = true
      var i = 0
      while (i < cs.length) {
        cs(i).append(new ColumnarArray(cols(i), 0, n), n)
        i += 1
      }
      inBatch += n
      rows += n
      if (inBatch >= opts.batchRows) flushBatch()
    case _ =>
      val view = new ColumnarBatch(cols, n)
      var r = 0
      while (r < n) {
        write(view.getRow(r))
        r += 1
      }
  }

  def write(row: InternalRow): Unit = {
    if (columnar) throw new IllegalStateException("rows after columns in one stretch write")
    arrow.write(row)
    inBatch += 1
    rows += 1
    if (inBatch >= opts.batchRows) flushBatch()
  }

  /** Ends the stream; the receiver's reply says it staged every row. */
  def commit(): StretchCommitMessage = {
    flushBatch()
    stream.end()
    client.out.flush()
    val reply = client.reply()
    val got = reply.path("rows").asLong(-1)
    if (got != rows) {
      throw new IOException(s"stretch receiver at '$endpoint' staged $got rows of $rows sent")
    }
    StretchCommitMessage(endpoint, partitionId, taskId, rows)
  }

  def close(): Unit = if (open) {
    open = false
    try {
      try dicts.foreach(_.close()) finally arrow.root.close()
    } finally client.close()
  }
}
