package org.apache.spark.sql.stretch

import java.util.concurrent.ConcurrentHashMap

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.JsonNode

import org.apache.spark.sql.{Dataset, Row, SparkSession, SQLContext}
import org.apache.spark.sql.classic.{Dataset => ClassicDataset}
import org.apache.spark.sql.catalyst.encoders.ExpressionEncoder
import org.apache.spark.sql.connector.read.streaming.ReportsSinkMetrics
import org.apache.spark.sql.execution.streaming.Sink
import org.apache.spark.sql.execution.streaming.sources.{ForeachBatchSink, PythonForeachBatchFunction}
import org.apache.spark.sql.sources.StreamSinkProvider
import org.apache.spark.sql.streaming.OutputMode
import org.apache.spark.sql.types.{DataType, StructType}

/** The stretch figures of a query, asked once per progress update (implemented in Python). */
trait StretchSinkMetrics {
  /** A JSON object of string values: the sink metrics of the query's progress. */
  def metrics(): String

  /** A JSON object: the query's state operator in its progress (`StateOperatorProgress`'s
   *  fields, `customMetrics` an object of longs), `{}` before the engine's first batch. */
  def state(): String
}

/**
 * `foreachBatch` as Spark runs it (its own [[ForeachBatchSink]]: the same batch DataFrame, the
 * same error wrapping), whose progress also carries the stretch query's figures as the sink's
 * custom metrics ([[ReportsSinkMetrics]]: `StreamingQueryProgress.sink.metrics`), so every
 * `StreamingQueryListener` and dashboard of the query sees them with its progress events.
 *
 * The Python driver registers the batch function (pyspark's own `ForeachBatchFunction`), the
 * metrics callback and the stream's schema under a key, and starts the query with
 * `format(classOf[StretchBatchSinkProvider].getName).option("stretch.sink", key)`.
 */
class StretchBatchSinkProvider extends StreamSinkProvider {
  override def createSink(sqlContext: SQLContext, parameters: Map[String, String],
                          partitionColumns: Seq[String], outputMode: OutputMode): Sink = {
    val key = parameters.getOrElse(StretchBatchSink.KeyOption, throw new IllegalArgumentException(
      s"stretch: option '${StretchBatchSink.KeyOption}' names no registered batch function"))
    val (fn, metrics, schema) = Option(StretchBatchSink.registered.get(key)).getOrElse(
      throw new IllegalArgumentException(s"stretch: no batch function registered as '$key'"))
    // (the query's session: its state operator finds the running query through it)
    StretchBatchSink.sessions.put(key, sqlContext.sparkSession)
    new StretchBatchSink(fn, metrics, schema)
  }
}

class StretchBatchSink(fn: PythonForeachBatchFunction, source: StretchSinkMetrics,
                       schema: StructType)
  extends ForeachBatchSink[Row]((ds, batchId) => fn.call(ds, batchId),
    ExpressionEncoder(schema)) with ReportsSinkMetrics {

  override def metrics(): java.util.Map[String, String] = StretchBatchSink.figures(source)

  override def addBatch(batchId: Long, data: Dataset[Row]): Unit = {
    super.addBatch(batchId, data)
    StretchState.committed(data.asInstanceOf[ClassicDataset[Row]].queryExecution.executedPlan)
  }
}

object StretchBatchSink {
  val KeyOption = "stretch.sink"

  private[stretch] val registered =
    new ConcurrentHashMap[String, (PythonForeachBatchFunction, StretchSinkMetrics, StructType)]()

  /** Register a query's batch function, metrics callback and stream schema (JSON) under `key`
   *  (kept for the query's restarts in the same session; [[unregister]] drops it). */
  def register(key: String, fn: PythonForeachBatchFunction, metrics: StretchSinkMetrics,
               schemaJson: String): Unit =
    registered.put(key, (fn, metrics, DataType.fromJson(schemaJson).asInstanceOf[StructType]))

  def unregister(key: String): Unit = {
    registered.remove(key)
    sessions.remove(key)
  }

  private[stretch] val sessions = new ConcurrentHashMap[String, SparkSession]()

  /** The state operator figures of the query registered as `key` (null: none, or the callback
   *  failed: a progress update must not fail the query). */
  private[stretch] def stateFigures(key: String): JsonNode =
    Option(registered.get(key)).map(r => parsed(r._2)).orNull

  private[stretch] def parsed(source: StretchSinkMetrics): JsonNode =
    try StretchPlans.mapper.readTree(source.state()) catch { case _: Exception => null }

  /** The figures callbacks of stretch aggregations in a plan, by aggregation id (for
   *  [[StretchDeltaSink]]: the engine appending a `stretch(df)` query's rows to Delta). */
  private[stretch] val byAggregation = new ConcurrentHashMap[String, StretchSinkMetrics]()

  def registerFigures(aggId: String, metrics: StretchSinkMetrics): Unit =
    byAggregation.put(aggId, metrics)

  /** A callback's figures as a sink's metrics (none if it fails or has none). */
  def figures(source: StretchSinkMetrics): java.util.Map[String, String] = {
    val out = new java.util.HashMap[String, String]()
    if (source != null) {
      try {
        val node = StretchPlans.mapper.readTree(source.metrics())
        node.fields().asScala.foreach { e => out.put(e.getKey, e.getValue.asText()) }
      } catch {
        case _: Exception => // (no figures this time: a progress update must not fail the query)
      }
    }
    out
  }
}
