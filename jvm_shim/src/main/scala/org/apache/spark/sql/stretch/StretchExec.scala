package org.apache.spark.sql.stretch

import java.util.concurrent.{ExecutionException, FutureTask}

import scala.jdk.CollectionConverters._
import scala.util.control.NonFatal

import com.fasterxml.jackson.databind.JsonNode

import org.apache.spark.rdd.RDD
import org.apache.spark.sql.Row
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.{Attribute, UnsafeProjection}
import org.apache.spark.sql.catalyst.types.DataTypeUtils
import org.apache.spark.sql.classic.{Dataset => ClassicDataset, SparkSession => ClassicSession}
import org.apache.spark.sql.execution.{BinaryExecNode, SparkPlan}
import org.apache.spark.sql.execution.python.streaming.{FlatMapGroupsInPandasWithStateExec, TransformWithStateInPySparkExec}
import org.apache.spark.sql.execution.streaming.operators.stateful.{SessionWindowStateStoreSaveExec, StateStoreSaveExec, StateStoreWriter}
import org.apache.spark.sql.execution.streaming.runtime.StreamExecution
import org.apache.spark.sql.execution.streaming.state.{StateStoreId, StateStoreProviderId}
import org.apache.spark.sql.util.CaseInsensitiveStringMap

/** What the driver's handler (Python) does with a micro-batch: a JSON answer,
 * `{"endpoint": ..., "stream": ..., "rows": n, "splits": k}`.
 * `sink` is empty, or (from [[StretchDeltaSink]]) the JSON of the Delta table the engine
 * appends the batch's rows to itself (`{"path": ..., "schema": ...}`; the answer then offers
 * nothing). `batch` is what Spark gave the operator for this batch (JSON: `operator_id`, the
 * Spark state operator of the marker's chain; `batch_ts_ms`, `late_watermark_ms`,
 * `watermark_ms` (eviction), when its state operator has them; `query_id`; `empty` for a
 * no-data batch). */
trait StretchBatchHandler {
  def onBatch(id: String, batchId: Long, outputMode: String, stateDir: String, runId: String,
              input: ClassicDataset[Row], inputPlan: SparkPlan, sink: String,
              batch: String): String
  /** Spark stops the query while `onBatch` of `batchId` runs: give its step up. */
  def cancel(id: String, runId: String, batchId: Long): Unit
}

object StretchExec {
  /** `call` (the driver's handler, through py4j) on a thread of its own, waited for here: a
   * py4j callback does not return when this thread is interrupted, and Spark's
   * `StreamingQuery.stop()` interrupts the query's thread and waits for it. Interrupted,
   * `cancel` runs (the handler gives the step up) and the interrupt is thrown, as Spark
   * expects of a stopped query. The thread inherits this one's local properties (the
   * query's job group, which the stop cancels): the handler's Spark jobs run as before. */
  def interruptibly[T](call: => T, cancel: => Unit): T = {
    val task = new FutureTask[T](() => call)
    val t = new Thread(task, s"${Thread.currentThread().getName}-stretch")
    t.setDaemon(true)
    t.start()
    try task.get()
    catch {
      case e: InterruptedException =>
        try cancel catch { case NonFatal(_) => }  // (best effort: the query is stopping)
        throw e
      case e: ExecutionException => throw e.getCause
    }
  }
}

case class StretchExec(aggId: String, native: SparkPlan, input: SparkPlan, out: Seq[Attribute])
  extends BinaryExecNode {
  override def left: SparkPlan = native
  override def right: SparkPlan = input
  override def output: Seq[Attribute] = out
  override def nodeName: String =
    if (StretchPlans.grouped(aggId)) "StretchGroupsWithState" else "StretchAggregate"
  override protected def withNewChildrenInternal(
      newLeft: SparkPlan, newRight: SparkPlan): StretchExec = copy(native = newLeft, input = newRight)

  /** Hand this micro-batch's input to the driver's handler (with `sink` for the engine's own
   * Delta append, or ""): its answer, with the chain's state stores reported committed. */
  def step(sink: String): JsonNode = {
    val batch = StretchPlans.mapper.createObjectNode()
    val (save, outputMode) = native.collectFirst[(StateStoreWriter, Option[String])] {
      case s: StateStoreSaveExec =>
        s.eventTimeWatermarkForEviction.foreach(w => batch.put("watermark_ms", w))
        (s, s.outputMode.map(_.toString))
      case s: SessionWindowStateStoreSaveExec =>
        s.eventTimeWatermarkForEviction.foreach(w => batch.put("watermark_ms", w))
        (s, s.outputMode.map(_.toString))
      case s: FlatMapGroupsInPandasWithStateExec =>
        // (applyInPandasWithState: the batch's time and watermarks, as Spark gives them to it)
        s.batchTimestampMs.foreach(t => batch.put("batch_ts_ms", t))
        s.eventTimeWatermarkForLateEvents.foreach(w => batch.put("late_watermark_ms", w))
        s.eventTimeWatermarkForEviction.foreach(w => batch.put("watermark_ms", w))
        (s, Some(s.outputMode.toString))
      case s: TransformWithStateInPySparkExec =>
        // (transformWithStateInPandas: the same, as Spark gives them to its operator)
        s.batchTimestampMs.foreach(t => batch.put("batch_ts_ms", t))
        s.eventTimeWatermarkForLateEvents.foreach(w => batch.put("late_watermark_ms", w))
        s.eventTimeWatermarkForEviction.foreach(w => batch.put("watermark_ms", w))
        (s, Some(s.outputMode.toString))
    }.getOrElse(
      throw new IllegalStateException("stretch: Spark planned no state operator under " +
        s"the stretch marker: ${native.treeString}"))
    val info = save.stateInfo.getOrElse(
      throw new IllegalStateException("stretch: the operator has no state info (not run " +
        "by a streaming query?)"))
    val spark = session.asInstanceOf[ClassicSession]
    batch.put("operator_id", info.operatorId)
    Option(sparkContext.getLocalProperty(StreamExecution.QUERY_ID_KEY))
      .foreach(q => batch.put("query_id", q))
    // Spark's no-data batch: its sources are empty relations (nothing to hand over; not so
    // when a stateful operator, another stretch aggregation, lies between: it may emit rows)
    if (StretchIngest.empty(input)) batch.put("empty", true)
    val rdd = new StretchLazyRDD(sparkContext, input, spark)  // (run only by the rows path)
    val df = spark.internalCreateDataFrame(rdd, DataTypeUtils.fromAttributes(input.output))
    val handler = StretchPlans.handler(aggId)
    val answer = StretchPlans.mapper.readTree(StretchExec.interruptibly(
      handler.onBatch(aggId, info.storeVersion, outputMode.getOrElse("Append"),
        info.checkpointLocation, info.queryRunId.toString, df, input, sink, batch.toString),
      handler.cancel(aggId, info.queryRunId.toString, info.storeVersion)))
    // The chain's state operator is the query's in Spark's progress: the engine's figures
    // (of the latest batch it finished) as its metrics.
    if (answer.has("state")) StretchState.setChainMetrics(save, answer.get("state"))
    // Spark's state stores of the chain never run (the operator's, and those of a stateful
    // operator of the input, which the chain has a copy of): for the commit check a
    // foreachBatch sink gets (STATE_STORE_COMMIT_VALIDATION), they are reported as committed,
    // empty.
    val coordinator = spark.streams.stateStoreCoordinator
    native.foreach {
      case w: StateStoreWriter => w.stateInfo.foreach { i =>
        for (p <- 0 until i.numPartitions; name <- w.stateStoreNames) {
          coordinator.reportStateStoreCommit(StateStoreProviderId(
            StateStoreId(i.checkpointLocation, i.operatorId, p, name), i.queryRunId),
            i.storeVersion + 1, name)
        }
      }
      case _ =>
    }
    answer
  }

  override protected def doExecute(): RDD[InternalRow] = {
    val t = StretchPlans.translation(aggId)
    val answer = step("")
    val rows = answer.get("rows").asLong()
    if (rows == 0) return sparkContext.emptyRDD[InternalRow]
    val secret = if (answer.has("secret")) Map("secret" -> answer.get("secret").asText())
      else Map.empty[String, String]
    val opts = StretchOptions.parse(new CaseInsensitiveStringMap((Map(
      "endpoints" -> answer.get("endpoint").asText(), "stream" -> answer.get("stream").asText(),
      "splits" -> answer.get("splits").asText()) ++ secret).asJava))
    val factory = StretchReaderFactory(t.engineSchema, opts)
    val result = t.result
    val read = new StretchOutputRDD(sparkContext, StretchInputPartition.all(opts), factory)
    t.regroup match {
      case Some(g) => g(session.asInstanceOf[ClassicSession], read)
      case None => read.mapPartitionsWithIndexInternal { (i, it) =>
        val proj = UnsafeProjection.create(result)
        proj.initialize(i)
        it.map(proj)
      }
    }
  }
}
