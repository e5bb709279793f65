package org.apache.spark.sql.stretch

import java.util.UUID

import scala.collection.mutable.ArrayBuffer
import scala.jdk.CollectionConverters._

import org.apache.spark.{Dependency, OneToOneDependency, Partition, SparkContext, TaskContext}
import org.apache.spark.rdd.RDD
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.Attribute
import org.apache.spark.sql.classic.SparkSession
import org.apache.spark.sql.execution.{ColumnarToRowExec, FileSourceScanExec, FilterExec, InputAdapter, LocalTableScanExec, ProjectExec, SparkPlan, WholeStageCodegenExec}
import org.apache.spark.sql.execution.datasources.parquet.ParquetFileFormat
import org.apache.spark.sql.catalyst.util.DateTimeUtils
import org.apache.spark.sql.execution.streaming.operators.stateful.{EventTimeStats, EventTimeStatsAccum, EventTimeWatermarkExec}
import org.apache.spark.sql.internal.SQLConf
import org.apache.spark.sql.types.{StructField, StructType, TimestampNTZType, TimestampType}
import org.apache.spark.sql.util.CaseInsensitiveStringMap
import org.apache.spark.sql.vectorized.{ColumnVector, ColumnarBatch}

/**
 * A micro-batch's input to the host engine straight from its scan's columnar batches.
 *
 * `foreachBatch` hands a batch over as rows: the scan's columnar batches (Parquet, Delta) are
 * first copied row by row into unsafe rows (`ColumnarToRow`), which the `stretch` writer then
 * copies into Arrow. When the batch's plan is only a columnar scan under column pruning and
 * event-time watermarks, this runs the scan itself and converts its batches to Arrow directly,
 * skipping the unsafe rows (a third of the ingest job's time on the project machine). Everything
 * else is as with `df.write.format("stretch")`: the same receiver protocol and two-phase commit
 * (exactly the attempts Spark's job returned are published), and the watermarks' event-time
 * statistics fed as `EventTimeWatermarkExec` would, so Spark's own watermark and progress
 * (`numInputRows`, from the scan's metrics) are as if the rows had flowed through the plan.
 */
object StretchIngest {

  /** The columnar leaf, where each output column of the plan is in its output, and the
   * watermarks with the position of their event-time column. */
  private case class Shape(
      scan: SparkPlan, ordinals: Array[Int], watermarks: Seq[(EventTimeStatsAccum, Int)])

  private def shape(plan: SparkPlan): Option[Shape] = {
    val marks = ArrayBuffer.empty[EventTimeWatermarkExec]
    var p = plan
    var scan: SparkPlan = null
    while (scan == null) {
      p match {
        case w: EventTimeWatermarkExec if w.eventTime.dataType == TimestampType ||
            w.eventTime.dataType == TimestampNTZType => marks += w; p = w.child
        case w: WholeStageCodegenExec => p = w.child
        case s: StretchStateExec => p = s.child  // (the query's state operator: pass-through)
        case a: InputAdapter => p = a.child
        case pr: ProjectExec if pr.projectList.forall(_.isInstanceOf[Attribute]) => p = pr.child
        case c: ColumnarToRowExec =>
          var leaf = c.child
          while (leaf.isInstanceOf[InputAdapter]) leaf = leaf.asInstanceOf[InputAdapter].child
          if (!leaf.supportsColumnar || leaf.children.nonEmpty) return None
          scan = leaf
        case _ => return None
      }
    }
    val out = scan.output
    def ordinal(a: Attribute): Int = out.indexWhere(_.exprId == a.exprId)
    val ordinals = plan.output.map(ordinal).toArray
    val watermarks = marks.toSeq.map(w => (w.eventTimeStats, ordinal(w.eventTime)))
    if (ordinals.contains(-1) || watermarks.exists(_._2 < 0)) None
    else Some(Shape(scan, ordinals, watermarks))
  }

  /** Whether [[ingest]] takes `plan` columnar (else it returns -1 without running anything). */
  def supports(plan: SparkPlan): Boolean = shape(plan).isDefined

  /**
   * Writes the rows of `plan` (a micro-batch's executed plan) to the receivers at `endpoints`
   * as `stream`, committed like a `format("stretch")` write. Returns the number of rows, or -1
   * when the plan is not a columnar scan under only whole-stage codegen, attribute projections
   * and event-time watermarks (the caller then writes the batch through `format("stretch")`);
   * 0, sending nothing, when it reads no rows ([[empty]]).
   */
  def ingest(plan: SparkPlan, endpoints: String, stream: String): Long = {
    if (empty(plan)) return 0L  // (nothing to send: the engine steps the batch with no rows)
    val sh = shape(plan).getOrElse(return -1L)
    val opts = StretchOptions.parse(new CaseInsensitiveStringMap(
      Map(StretchOptions.ENDPOINTS -> endpoints, StretchOptions.STREAM -> stream).asJava))
    val schema = StructType(plan.output.map(a => StructField(a.name, a.dataType, a.nullable)))
    val tz = SQLConf.get.sessionLocalTimeZone
    val job = s"$stream-${UUID.randomUUID()}"
    val ordinals = sh.ordinals
    val watermarks = sh.watermarks
    val rdd = sh.scan.executeColumnar()
    try {
      val msgs = rdd.sparkContext.runJob(rdd, (ctx: TaskContext, it: Iterator[ColumnarBatch]) => {
        val out = new TaskStream(schema, opts, job, tz, ctx.partitionId(), ctx.taskAttemptId())
        try {
          it.foreach { batch =>
            val n = batch.numRows()
            watermarks.foreach { case (acc, i) => addEventTimes(acc, batch.column(i), n) }
            out.writeColumns(ordinals.map(batch.column), n)
          }
          out.commit()
        } finally out.close()
      })
      StretchBatchWrite.commit(opts, job, msgs.toSeq)
      msgs.map(_.rows).sum
    } catch {
      case e: Throwable =>
        StretchBatchWrite.abort(opts, job)
        throw e
    }
  }

  // Options of a file source that change how Spark reads Parquet files (the engine then does not).
  private val readOptions = Set("ignorecorruptfiles", "ignoremissingfiles", "datetimerebasemode",
    "int96rebasemode", "mergeschema")

  /**
   * The files of a micro-batch whose plan is a plain Parquet scan, for the host engine to read
   * itself (Spark would only read and hand them over): a `FileSourceScanExec` of
   * `ParquetFileFormat`, or of Delta's when it reads plain Parquet ([[plainParquet]]), with no
   * partition columns, filters or buckets, and Spark's defaults for corrupt and missing files,
   * datetime rebasing and INT96 (read as timestamps, not time-zone converted); none (empty)
   * for an input of no rows ([[empty]]). Null otherwise. The engine checks the files
   * themselves (column names, types, legacy writers) and declines what Spark would read
   * differently; then, or when this is null, the batch goes through [[ingest]].
   */
  def parquetFiles(plan: SparkPlan): Array[String] =
    if (empty(plan)) Array.empty else shape(plan).map(_.scan) match {
      case Some(fs: FileSourceScanExec) if plainParquet(fs)
          && fs.relation.partitionSchema.isEmpty && fs.partitionFilters.isEmpty
          && fs.dataFilters.isEmpty && !fs.bucketedScan
          && !SQLConf.get.ignoreCorruptFiles && !SQLConf.get.ignoreMissingFiles
          && SQLConf.get.isParquetINT96AsTimestamp
          && !SQLConf.get.isParquetINT96TimestampConversion
          && !fs.relation.options.keys.exists(k => readOptions(k.toLowerCase)) =>
        fs.relation.location.inputFiles
      case _ => null
    }

  /** Whether `plan` reads no rows: an empty local relation under operators that make no row
   * of none (a no-data micro-batch's input: Spark puts an empty relation in its source's
   * place). No file to read then, nor a job to run. */
  def empty(plan: SparkPlan): Boolean = plan match {
    case l: LocalTableScanExec => l.rows.isEmpty
    case p @ (_: EventTimeWatermarkExec | _: WholeStageCodegenExec | _: InputAdapter |
              _: ProjectExec | _: FilterExec | _: StretchStateExec) => empty(p.children.head)
    case _ => false
  }

  /**
   * Whether the scan reads its files as plain Parquet: `ParquetFileFormat` itself, or Delta's
   * `DeltaParquetFileFormat` (reached by reflection: the shim does not link Delta) when it only
   * reads: no column mapping (physical names are the logical ones), not a change-data read, no
   * Delta-internal column (deletion-vector row flags, row tracking), and a file index of
   * `AddFile`s none of which carries a deletion vector.
   */
  private def plainParquet(fs: FileSourceScanExec): Boolean = {
    val format = fs.relation.fileFormat
    if (format.getClass == classOf[ParquetFileFormat]) return true
    if (format.getClass.getName != "org.apache.spark.sql.delta.DeltaParquetFileFormat") {
      return false
    }
    def call(o: AnyRef, name: String): AnyRef = o.getClass.getMethod(name).invoke(o)
    try {
      val mapping = call(call(format, "columnMappingMode"), "name")
      val cdc = call(format, "isCDCRead").asInstanceOf[Boolean]
      val internal = (fs.relation.dataSchema.fieldNames ++ fs.output.map(_.name))
        .exists(_.startsWith("__delta_internal"))
      val files = call(fs.relation.location, "addFiles").asInstanceOf[Seq[AnyRef]]
      mapping == "none" && !cdc && !internal && files.forall(f => call(f, "deletionVector") == null)
    } catch {
      case _: ReflectiveOperationException | _: ClassCastException => false  // another Delta
    }
  }

  /** The plan's output column names (what the engine reads from the files), in order. */
  def columnNames(plan: SparkPlan): Array[String] = plan.output.map(_.name).toArray

  /** Per watermark of the plan, the name of its event-time column. */
  def watermarkColumns(plan: SparkPlan): Array[String] = shape(plan) match {
    case Some(sh) => sh.watermarks.map { case (_, i) => sh.scan.output(i).name }.toArray
    case None => Array.empty
  }

  /**
   * Records what the batch's rows would have recorded flowing through `plan` when the engine
   * read its files: `rows` in the scan's `numOutputRows` (Spark's `numInputRows`) and, for
   * watermark `i`, the event-time statistics of its column (milliseconds, as
   * `EventTimeWatermarkExec` adds them), merged into its accumulator on the driver, where
   * Spark's watermark and progress read them.
   */
  def recordRead(plan: SparkPlan, rows: Long): Unit =
    shape(plan).foreach(_.scan.metrics.get("numOutputRows").foreach(_.add(rows)))

  def recordEventTimes(plan: SparkPlan, i: Int, max: Long, min: Long, avg: Double,
                       count: Long): Unit = if (count > 0) {
    shape(plan).foreach(sh => sh.watermarks(i)._1.merge(
      new EventTimeStatsAccum(EventTimeStats(max, min, avg, count))))
  }

  /** What `EventTimeWatermarkExec` adds per row: the event time in milliseconds. */
  private def addEventTimes(acc: EventTimeStatsAccum, v: ColumnVector, n: Int): Unit = {
    var r = 0
    while (r < n) {
      if (!v.isNullAt(r)) acc.add(DateTimeUtils.microsToMillis(v.getLong(r)))
      r += 1
    }
  }
}

/**
 * The rows of `plan` (a micro-batch's input, executed under its `session`), prepared only when
 * a job reads them: the engine usually reads the batch's files itself, and Spark would prepare
 * the scan (its read RDD, the whole-stage code) for nothing, 20-80 ms a micro-batch.
 */
class StretchLazyRDD(sc: SparkContext, @transient plan: SparkPlan,
                     @transient session: SparkSession) extends RDD[InternalRow](sc, Nil) {
  // (forced by the first `partitions`, on the thread submitting the job, never by the scheduler)
  @transient private lazy val rows: RDD[InternalRow] = session.withActive(plan.execute())

  override protected def getDependencies: Seq[Dependency[_]] = Seq(new OneToOneDependency(rows))
  override protected def getPartitions: Array[Partition] = rows.partitions
  override protected def getPreferredLocations(split: Partition): Seq[String] =
    rows.preferredLocations(split)
  override def compute(split: Partition, context: TaskContext): Iterator[InternalRow] =
    firstParent[InternalRow].iterator(split, context)
}
