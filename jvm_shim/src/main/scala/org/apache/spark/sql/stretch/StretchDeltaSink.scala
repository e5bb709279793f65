package org.apache.spark.sql.stretch

import org.apache.spark.sql.{Dataset, Row, SQLContext}
import org.apache.spark.sql.classic.{Dataset => ClassicDataset}
import org.apache.spark.sql.connector.read.streaming.ReportsSinkMetrics
import org.apache.spark.sql.execution.datasources.DataSource
import org.apache.spark.sql.execution.streaming.Sink
import org.apache.spark.sql.sources.StreamSinkProvider
import org.apache.spark.sql.streaming.OutputMode

/**
 * A Delta table written by the host engine itself, for a stretch aggregation written straight
 * to it (`spark_stretch.stretch(df).writeStream.format("delta").start(path)`; the Python
 * writer chooses this sink then).
 *
 * Each micro-batch's plan is the shim's [[StretchExec]] over the aggregation's input: the sink
 * has it step the batch with the table as its sink, and the engine appends the batch's rows to
 * the table in one Delta commit carrying the batch's `txn` (app id and version, as Spark's
 * Delta writer adds them), so a batch replayed after a restart lands once. Any other plan, and
 * a batch the handler leaves to Spark, goes to Delta's own sink with the same options. Its
 * progress carries the stretch aggregation's figures as the sink's custom metrics.
 */
class StretchDeltaSinkProvider extends StreamSinkProvider {
  override def createSink(sqlContext: SQLContext, parameters: Map[String, String],
                          partitionColumns: Seq[String], outputMode: OutputMode): Sink =
    new StretchDeltaSink(sqlContext, parameters, partitionColumns, outputMode)
}

class StretchDeltaSink(sqlContext: SQLContext, parameters: Map[String, String],
                       partitionColumns: Seq[String], outputMode: OutputMode)
  extends Sink with ReportsSinkMetrics {
  private val path = parameters.getOrElse("path",
    throw new IllegalArgumentException("stretch: the Delta sink needs a path"))

  // Delta's own sink, made only if a batch needs it
  private lazy val delta: Sink = DataSource(sqlContext.sparkSession, className = "delta",
    options = parameters, partitionColumns = partitionColumns).createSink(outputMode)

  @volatile private var aggId: String = null  // the stretch aggregation it last appended

  override def metrics(): java.util.Map[String, String] =
    StretchBatchSink.figures(Option(aggId).map(StretchBatchSink.byAggregation.get).orNull)

  override def addBatch(batchId: Long, data: Dataset[Row]): Unit = {
    // The exec must be the whole plan: what the engine writes is the aggregation's rows (a
    // filter or projection over them is Spark's to run).
    data.asInstanceOf[ClassicDataset[Row]].queryExecution.executedPlan match {
      case exec: StretchExec =>
        aggId = exec.aggId
        val sink = StretchPlans.mapper.createObjectNode()
          .put("path", path).put("schema", data.schema.json)
        exec.step(sink.toString)
      case _ => delta.addBatch(batchId, data)
    }
  }

  override def toString: String = s"StretchDeltaSink[$path]"
}
