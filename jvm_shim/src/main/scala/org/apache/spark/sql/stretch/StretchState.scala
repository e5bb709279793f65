package org.apache.spark.sql.stretch

import java.util.UUID

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.JsonNode
import org.apache.hadoop.conf.Configuration
import org.apache.hadoop.fs.Path

import org.apache.spark.rdd.RDD
import org.apache.spark.sql.{Row, SparkSession}
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.Attribute
import org.apache.spark.sql.catalyst.plans.logical.{LogicalPlan, UnaryNode}
import org.apache.spark.sql.classic.{Dataset => ClassicDataset}
import org.apache.spark.sql.execution.{SparkPlan, UnaryExecNode}
import org.apache.spark.sql.execution.metric.SQLMetric
import org.apache.spark.sql.execution.streaming.operators.stateful.{StatefulOperatorStateInfo, StateStoreWriter}
import org.apache.spark.sql.execution.streaming.runtime.{MicroBatchExecution, StreamExecution, StreamingQueryWrapper}
import org.apache.spark.sql.execution.streaming.state.{StateSchemaValidationResult, StateStoreId, StateStoreProviderId}
import org.apache.spark.sql.streaming.StateOperatorProgress

/**
 * The state operator of a stretch query whose engine runs beside Spark's plan
 * (`stretchAggregate`: a `foreachBatch` query whose
 * sink is [[StretchBatchSink]]), so that `StreamingQueryProgress.stateOperators` has it as
 * native Spark has its own aggregation. (`stretch(df)` and the `applyInPandasWithState` drop-in
 * are inside Spark's plan, whose own state operator is there: [[StretchExec]].)
 *
 * Spark builds a progress's state operators from the [[StateStoreWriter]] nodes of the batch's
 * executed plan (`ProgressReporter.extractStateOperatorMetrics`), so the marker puts one over
 * the query's input: a pass-through node (no per-row work, no Spark job of its own) whose
 * `getProgress` is the engine's latest figures, asked on the driver when Spark builds the
 * progress (the callback registered under `key`). It never runs another batch, and it has one
 * state store, which [[StretchBatchSink]] reports committed after the batch (Spark 4.2's commit
 * check for `foreachBatch`).
 */
case class StretchStateMarker(key: String, name: String, child: LogicalPlan) extends UnaryNode {
  override def output: Seq[Attribute] = child.output
  override protected def withNewChildInternal(c: LogicalPlan): StretchStateMarker = copy(child = c)
}

case class StretchStateExec(key: String, name: String, stateInfo: Option[StatefulOperatorStateInfo],
                            child: SparkPlan) extends UnaryExecNode with StateStoreWriter {
  override def output: Seq[Attribute] = child.output
  override def nodeName: String = "StretchState"
  override def shortName: String = name
  override protected def doExecute(): RDD[InternalRow] = child.execute()
  override protected def withNewChildInternal(c: SparkPlan): StretchStateExec = copy(child = c)

  // No SQL metrics: the figures are the engine's (getProgress), and Spark's defaults for a
  // StateStoreWriter would create a metric per shuffle partition and store instance per batch.
  override lazy val metrics: Map[String, SQLMetric] = Map.empty
  override lazy val instanceMetrics = Map.empty

  override def validateAndMaybeEvolveStateSchema(
      hadoopConf: Configuration, batchId: Long, stateSchemaVersion: Int)
      : List[StateSchemaValidationResult] =
    // (the engine keeps its state under <checkpoint>/stretch: no schema file in Spark's)
    List(StateSchemaValidationResult(evolvedSchema = false, schemaPath = ""))

  override def getProgress(): StateOperatorProgress =
    StretchState.progress(name, StretchBatchSink.stateFigures(key),
      stateInfo.map(_.numPartitions.toLong).getOrElse(-1L))
}

object StretchState {
  /** `df` with the state marker of the stretch query registered as `key` over it. */
  def mark(df: ClassicDataset[Row], key: String, name: String): ClassicDataset[Row] = {
    StretchPlans.install(df.sparkSession)
    ClassicDataset.ofRows(df.sparkSession, StretchStateMarker(key, name, df.logicalPlan))
  }

  /** The marker's state info in the micro-batch being planned: the running query's own
   *  (checkpoint, run id, batch), as operator 0 with one store, or None outside a query. */
  private[stretch] def stateInfo(key: String): Option[StatefulOperatorStateInfo] = {
    val session = StretchBatchSink.sessions.get(key)
    val sc = SparkSession.getActiveSession.map(_.sparkContext).orNull
    if (session == null || sc == null) return None
    val queryId = sc.getLocalProperty(StreamExecution.QUERY_ID_KEY)
    val batchId = sc.getLocalProperty(MicroBatchExecution.BATCH_ID_KEY)
    if (queryId == null || batchId == null) return None
    Option(session.streams.get(UUID.fromString(queryId))).collect {
      case q: StreamingQueryWrapper =>
        val run = q.streamingQuery
        StatefulOperatorStateInfo(new Path(run.resolvedCheckpointRoot, "state").toString,
          run.runId, operatorId = 0, storeVersion = batchId.toLong, numPartitions = 1)
    }
  }

  /** The state stores of the batch's stretch state nodes, reported committed (they are the
   *  engine's, which has the batch by then). */
  private[stretch] def committed(plan: SparkPlan): Unit = plan.foreach {
    case s: StretchStateExec => s.stateInfo.foreach { info =>
      val coordinator = s.session.streams.stateStoreCoordinator
      for (p <- 0 until info.numPartitions; name <- s.stateStoreNames) {
        coordinator.reportStateStoreCommit(StateStoreProviderId(
          StateStoreId(info.checkpointLocation, info.operatorId, p, name), info.queryRunId),
          info.storeVersion + 1, name)
      }
    }
    case _ =>
  }

  private def long(js: JsonNode, field: String): Long =
    if (js != null && js.has(field)) js.get(field).asLong() else 0L

  /** A state operator's progress from the engine's figures (`{"numRowsTotal": ..., ...,
   *  "customMetrics": {...}}`; zeros when there are none yet). */
  def progress(name: String, js: JsonNode, shufflePartitions: Long): StateOperatorProgress = {
    val custom = new java.util.HashMap[String, java.lang.Long]()
    if (js != null && js.has("customMetrics")) {
      js.get("customMetrics").fields().asScala.foreach { e =>
        custom.put(e.getKey, java.lang.Long.valueOf(e.getValue.asLong()))
      }
    }
    new StateOperatorProgress(name, long(js, "numRowsTotal"), long(js, "numRowsUpdated"),
      long(js, "allUpdatesTimeMs"), long(js, "numRowsRemoved"), long(js, "allRemovalsTimeMs"),
      long(js, "commitTimeMs"), long(js, "memoryUsedBytes"),
      long(js, "numRowsDroppedByWatermark"), shufflePartitions,
      long(js, "numStateStoreInstances"), custom)
  }

  /** Spark's own state operator of a `stretch(df)` chain (its `StateStoreSaveExec`, which
   *  never runs) given the engine's figures of the batch as its SQL metrics, which Spark's
   *  progress reads on the driver (`StateStoreWriter.getProgress`). */
  def setChainMetrics(save: StateStoreWriter, js: JsonNode): Unit = if (js != null) {
    def set(metric: String, field: String): Unit =
      save.metrics.get(metric).foreach(_.set(long(js, field)))
    set("numTotalStateRows", "numRowsTotal")
    set("numUpdatedStateRows", "numRowsUpdated")
    set("numRemovedStateRows", "numRowsRemoved")
    set("allUpdatesTimeMs", "allUpdatesTimeMs")
    set("stateMemory", "memoryUsedBytes")
    set("numRowsDroppedByWatermark", "numRowsDroppedByWatermark")
    set("numStateStoreInstances", "numStateStoreInstances")
    set("numOutputRows", "numOutputRows")
    // The drop-in's store on disk as the configured state store names its own state's size
    // (HDFS-backed: the current version's; RocksDB: its SST files').
    val custom = js.get("customMetrics")
    if (custom != null && custom.has("stateOnDiskBytes")) {
      val disk = custom.get("stateOnDiskBytes").asLong()
      Seq("stateOnCurrentVersionSizeBytes", "rocksdbSstFileSize")
        .foreach(m => save.metrics.get(m).foreach(_.set(disk)))
    }
    // The operator's own counters the engine keeps under Spark's names (transformWithState's
    // numValueStateVars, ...), into the operator's metrics of the same names.
    if (custom != null) custom.fields().asScala.foreach { e =>
      save.metrics.get(e.getKey).foreach(_.set(e.getValue.asLong()))
    }
  }
}
