package org.apache.spark.sql.stretch

import java.io.IOException

import org.apache.arrow.vector.ipc.ArrowStreamWriter

import org.apache.spark.TaskContext
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.connector.write.{BatchWrite, DataWriter, DataWriterFactory, PhysicalWriteInfo, Write, WriteBuilder, WriterCommitMessage}
import org.apache.spark.sql.execution.arrow.ArrowWriter
import org.apache.spark.sql.internal.SQLConf
import org.apache.spark.sql.types.StructType

class StretchWriteBuilder(schema: StructType, opts: StretchOptions, queryId: String)
  extends WriteBuilder {
  override def build(): Write = new Write {
    override def toBatch: BatchWrite = new StretchBatchWrite(schema, opts, queryId)
  }
}

/** What a task reports on commit: where its rows went and under which attempt. */
case class StretchCommitMessage(endpoint: String, partition: Int, taskId: Long, rows: Long)
  extends WriterCommitMessage

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

  override def commit(messages: Array[WriterCommitMessage]): Unit = {
    val msgs = messages.collect { case m: StretchCommitMessage => m }
    // Every endpoint hears the commit, also those that got no rows, so each sees every job end.
    val byEndpoint = msgs.groupBy(_.endpoint)
    (opts.endpoints.map(_._2).toSet ++ byEndpoint.keySet).foreach { endpoint =>
      val client = new ReceiverClient(endpoint, opts.timeoutMs)
      try {
        val h = ReceiverClient.header("commit", opts.stream)
        h.put("job", job)
        val arr = h.putArray("attempts")
        byEndpoint.getOrElse(endpoint, Array.empty[StretchCommitMessage]).sortBy(_.partition)
          .foreach { m => arr.addArray().add(m.partition).add(m.taskId) }
        client.request(h)
      } finally client.close()
    }
  }

  override def abort(messages: Array[WriterCommitMessage]): Unit = {
    opts.endpoints.map(_._2).distinct.foreach { endpoint =>
      try {
        val client = new ReceiverClient(endpoint, opts.timeoutMs)
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

  private val endpoint = opts.endpointFor(StretchOptions.hostOf())
  private val client = new ReceiverClient(endpoint, opts.timeoutMs)
  private val arrow = ArrowWriter.create(schema, timeZoneId, true, false)
  private val stream = new ArrowStreamWriter(arrow.root, null, client.out)
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

  private def flushBatch(): Unit = if (inBatch > 0) {
    arrow.finish()
    stream.writeBatch()
    arrow.reset()
    inBatch = 0
  }

  override def write(row: InternalRow): Unit = {
    arrow.write(row)
    inBatch += 1
    rows += 1
    if (inBatch >= opts.batchRows) flushBatch()
  }

  override def commit(): WriterCommitMessage = {
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

  override def abort(): Unit = close()

  override def close(): Unit = if (open) {
    open = false
    try arrow.root.close() finally client.close()
  }
}
