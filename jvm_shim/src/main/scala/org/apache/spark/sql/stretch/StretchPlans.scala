package org.apache.spark.sql.stretch

import java.util.concurrent.ConcurrentHashMap

import com.fasterxml.jackson.databind.ObjectMapper
import com.fasterxml.jackson.databind.node.ObjectNode

import org.apache.spark.sql.Row
import org.apache.spark.sql.catalyst.analysis.UnsupportedOperationChecker
import org.apache.spark.sql.catalyst.expressions.{Alias, Attribute, BoundReference, PythonUDF}
import org.apache.spark.sql.catalyst.plans.logical.{Aggregate, EventTimeWatermark, Filter, FlatMapGroupsInPandasWithState, LogicalPlan, Project, TransformWithStateInPySpark, UpdateEventTimeWatermarkColumn}
import org.apache.spark.sql.catalyst.streaming.InternalOutputModes
import org.apache.spark.sql.catalyst.types.DataTypeUtils
import org.apache.spark.sql.classic.{Dataset => ClassicDataset, SparkSession => ClassicSession}

/**
 * What Python calls (`driver/jvm.py`'s `ShimPlans`, as `org.apache.spark.sql.stretch.StretchPlans`
 * over py4j): install the strategy in a session, analyze an aggregation (kept under its id as a
 * [[Translation]], or the reason it falls back), put the marker over it, register the handler
 * of its micro-batches. It keeps the driver's translations and handlers, which the exec looks
 * up by id. The work itself is elsewhere: [[StretchAnalysis]], [[StretchAggregates]] and
 * [[StretchTranslate]] translate, [[StretchStrategy]] plans the marker, [[StretchExec]] runs it.
 */
object StretchPlans {
  private[stretch] val mapper = new ObjectMapper()
  private val translations = new ConcurrentHashMap[String, Translation]()
  private val handlers = new ConcurrentHashMap[String, StretchBatchHandler]()

  def translation(id: String): Translation = Option(translations.get(id)).getOrElse(
    throw new IllegalStateException(s"stretch: aggregation $id is unknown to this driver"))
  def handler(id: String): StretchBatchHandler = Option(handlers.get(id)).getOrElse(
    throw new IllegalStateException(s"stretch: no handler for aggregation $id (its session " +
      "was stopped?)"))

  /** Plan the marker (once per session). */
  def install(spark: ClassicSession): Unit = synchronized {
    val methods = spark.experimental
    if (!methods.extraStrategies.contains(StretchStrategy)) {
      methods.extraStrategies = methods.extraStrategies :+ StretchStrategy
    }
  }

  def register(id: String, h: StretchBatchHandler): Unit = handlers.put(id, h)

  /** The schema (JSON) of the engine's input of aggregation `id`, as its micro-batches have it. */
  def inputSchema(id: String): String = translation(id).input.schema.json

  /** The aggregation `df` on the engine, as `df` with the marker over it. */
  def mark(df: ClassicDataset[Row], id: String): ClassicDataset[Row] = {
    val t = translation(id)
    // The chain is Spark's to plan, never to run. Under it, another stretch aggregation's marker
    // (this one aggregates its windows) is a stub of its columns over its input, so that Spark
    // plans that aggregation once (one state operator, which the exec runs), and the filter
    // `StretchTag(id)` makes the chain this aggregation's own: two aggregations over the same
    // input would otherwise share one exchange (Spark's reuse), which leaves the second without
    // a watermark.
    def own(p: LogicalPlan): LogicalPlan =
      Filter(StretchTag(id), p.transformDown { case m: StretchMarker => stub(m) })
    val chain = t.native match {
      case a: Aggregate if t.spec.has("session_end") => a.copy(child = own(a.child))
      case _ =>
        val ts = t.input.output.filter(_.metadata.contains(EventTimeWatermark.delayKey))
        Aggregate(ts, ts, own(t.input))
    }
    ClassicDataset.ofRows(df.sparkSession,
      StretchMarker(id, chain, t.input, chain.output ++ t.input.output, t.native.output))
  }

  /** A stretch aggregation's columns (never computed) over its input: what a chain that
   * aggregates its windows is planned over (the input keeps the watermark). */
  private def stub(m: StretchMarker): LogicalPlan = Project(m.out.map(at =>
    Alias(StretchTag(m.id, at.dataType), at.name)(exprId = at.exprId,
      explicitMetadata = Some(at.metadata))), m.input)

  /** The `applyInPandasWithState` drop-in: `native` (Spark's own
   * `groupBy(...).applyInPandasWithState(...)` over `input`) with the marker over it, the
   * drop-in registered as `id`. Spark plans its `FlatMapGroupsInPandasWithStateExec` (state
   * info, batch time, watermarks, no-data batches, its own checks, as natively) and never runs
   * it; the exec hands `input`'s rows to the engine and reads the function's rows back. */
  def markGrouped(native: ClassicDataset[Row], input: ClassicDataset[Row],
                  id: String): ClassicDataset[Row] = {
    val n = native.logicalPlan
    val in = input.logicalPlan
    val out = n.output
    val result = out.zipWithIndex.map { case (a, i) => BoundReference(i, a.dataType, a.nullable) }
    translations.put(id, Translation(n, in, DataTypeUtils.fromAttributes(out), result,
      mapper.createObjectNode().put("kind", "grouped")))
    ClassicDataset.ofRows(native.sparkSession, StretchMarker(id, n, in, out ++ in.output, out))
  }

  /** `df` read as a `groupBy(...).transformWithStateInPandas(...)` the engine runs:
   * `{"ok": true, "grouping": [names], "output_mode", "out_schema" (its own, JSON),
   * "time_mode", "pandas", "command"}`
   * (`command`: the pickled Python function, base64), or `{"ok": false, "reason": ...}`; with
   * `"tws"`: whether its last step is a transformWithState at all. */
  def transformInfo(df: ClassicDataset[Row]): String = {
    val out = mapper.createObjectNode()
    def no(reason: String): String = { out.put("ok", false); out.put("reason", reason); out.toString }
    val tws = transformOf(df.logicalPlan)
    out.put("tws", tws.isDefined)
    df.logicalPlan match {
      case f: FlatMapGroupsInPandasWithState => return pandasStateInfo(f, out)
      case _ =>
    }
    tws match {
      case Some(t) =>
        val (keys, input) = groupedBy(t.child, t.groupingAttributesLen)
        if (input.isEmpty) return no("its grouping is not by columns of the DataFrame")
        val missing = keys.filterNot(k => input.get.output.exists(_.exprId == k.exprId))
        if (missing.nonEmpty) {
          return no(s"it groups by expressions (${missing.map(_.name).mkString(", ")}), not " +
            "columns of the DataFrame; add them as columns first")
        }
        val udf = t.functionExpr match {
          case u: PythonUDF => u
          case other => return no(s"its function is a ${other.nodeName}")
        }
        out.put("initial", t.hasInitialState)
        if (t.hasInitialState) {
          val (ikeys, init) = groupedBy(t.initialState, t.initGroupingAttrsLen)
          if (init.isEmpty || !ikeys.forall(k => init.get.output.exists(_.exprId == k.exprId))) {
            return no("its initialState is not grouped by columns of its DataFrame")
          }
          val inames = out.putArray("initial_grouping")
          ikeys.foreach(k => inames.add(k.name))
        }
        out.put("ok", true)
        val names = out.putArray("grouping")
        keys.foreach(k => names.add(k.name))
        out.put("output_mode", t.outputMode.toString)
        out.put("out_schema", t.schema.json)
        out.put("time_mode", t.timeMode.toString)
        out.put("pandas", t.userFacingDataType.toString.toLowerCase.contains("pandas"))
        out.put("command", java.util.Base64.getEncoder.encodeToString(udf.func.command.toArray))
        out.toString
      case None =>
        no(s"the DataFrame's last step is ${df.logicalPlan.nodeName}, not groupBy(...)" +
          ".transformWithStateInPandas(...)")
    }
  }

  /** [[transformInfo]] of a `groupBy(...).applyInPandasWithState(...)`: `{"pandas_state": true,
   * "ok", "grouping", "output_mode", "timeout", "state_schema" (JSON), "command"}`. */
  private def pandasStateInfo(f: FlatMapGroupsInPandasWithState, out: ObjectNode): String = {
    out.put("pandas_state", true)
    val missing = f.groupingAttributes.filterNot(k => f.child.output.exists(_.exprId == k.exprId))
    val udf = f.functionExpr match {
      case u: PythonUDF => Some(u)
      case _ => None
    }
    if (missing.nonEmpty || udf.isEmpty) {
      out.put("ok", false)
      out.put("reason", if (udf.isEmpty) s"its function is a ${f.functionExpr.nodeName}"
        else s"it groups by expressions (${missing.map(_.name).mkString(", ")}), not " +
          "columns of the DataFrame; add them as columns first")
      return out.toString
    }
    out.put("ok", true)
    val names = out.putArray("grouping")
    f.groupingAttributes.foreach(k => names.add(k.name))
    out.put("output_mode", f.outputMode.toString)
    out.put("timeout", f.timeout.toString)
    out.put("state_schema", f.stateType.json)
    out.put("command", java.util.Base64.getEncoder.encodeToString(udf.get.func.command.toArray))
    out.toString
  }

  /** The transformWithState of a plan: its root, or under the stateless steps over it (row by
   * row: `select`/`where` with deterministic expressions) and the watermark column update that
   * `eventTimeColumnName` puts over it. */
  private def transformOf(plan: LogicalPlan): Option[TransformWithStateInPySpark] = plan match {
    case t: TransformWithStateInPySpark => Some(t)
    case UpdateEventTimeWatermarkColumn(_, _, c) => transformOf(c)
    case p @ (_: Project | _: Filter) if p.expressions.forall(_.deterministic) =>
      transformOf(p.children.head)
    case _ => None
  }

  /** [[markGrouped]] for a transformWithState `df` (over `input`): the marker in place of
   * Spark's node, the steps over it (see [[transformOf]]) kept over the marker (which outputs
   * the node's own attributes). */
  def markTransform(df: ClassicDataset[Row], input: ClassicDataset[Row],
                    id: String): ClassicDataset[Row] = {
    def over(plan: LogicalPlan): LogicalPlan = plan match {
      case t: TransformWithStateInPySpark =>
        markGrouped(ClassicDataset.ofRows(df.sparkSession, t), input, id).logicalPlan
      case step => step.withNewChildren(Seq(over(step.children.head)))
    }
    ClassicDataset.ofRows(df.sparkSession, over(df.logicalPlan))
  }

  /** The grouping attributes of a grouped side of a transformWithState (its input or its
   * initial state) and the DataFrame grouped (the plan under Spark's projection of the `len`
   * grouping attributes before its columns), if it is one. */
  private def groupedBy(side: LogicalPlan, len: Int): (Seq[Attribute], Option[LogicalPlan]) = {
    val keys = side.output.take(len)
    val grouped = side match {
      case Project(list, c) if list.drop(len).map(_.exprId) == c.output.map(_.exprId) => Some(c)
      case _ => None
    }
    (keys, grouped)
  }

  private def transformSide(df: ClassicDataset[Row], initial: Boolean): ClassicDataset[Row] = {
    df.logicalPlan match {  // (applyInPandasWithState: the DataFrame it groups, as it is)
      case f: FlatMapGroupsInPandasWithState => return ClassicDataset.ofRows(df.sparkSession, f.child)
      case _ =>
    }
    val t = transformOf(df.logicalPlan).getOrElse(throw new IllegalArgumentException(
      s"not a transformWithState: ${df.logicalPlan.nodeName}"))
    val (side, len) = if (initial) (t.initialState, t.initGroupingAttrsLen)
      else (t.child, t.groupingAttributesLen)
    groupedBy(side, len)._2.map(ClassicDataset.ofRows(df.sparkSession, _))
      .getOrElse(throw new IllegalArgumentException("not grouped by columns"))
  }

  /** The DataFrame a transformWithState groups (see [[transformInfo]]). */
  def transformInput(df: ClassicDataset[Row]): ClassicDataset[Row] = transformSide(df, false)

  /** The (batch) DataFrame of a transformWithState's `initialState`. */
  def transformInitial(df: ClassicDataset[Row]): ClassicDataset[Row] = transformSide(df, true)

  /** Whether `id` is the drop-in (else an aggregation). */
  def grouped(id: String): Boolean =
    Option(translations.get(id)).exists(t => t.spec.path("kind").asText() == "grouped")

  /** Spark's own check of aggregation `id` as a streaming query in output `mode` (throws
   * Spark's own error where Spark refuses it). */
  def checkNative(id: String, mode: String): Unit =
    UnsupportedOperationChecker.checkForStreaming(translation(id).native,
      InternalOutputModes(mode))

  /** The stretch aggregations of a streaming query's plan, each once, in the plan's order. */
  def markerIds(plan: LogicalPlan): Array[String] =
    plan.collect { case m: StretchMarker => m.id }.distinct.toArray

  /** Read `df` as a windowed aggregation the engine runs: `{"ok": true, "spec": ...}` (the
   * translation kept under `id`), or `{"ok": false, "reason": ...}`. */
  def analyze(df: ClassicDataset[Row], id: String): String = {
    val out = mapper.createObjectNode()
    try {
      val t = StretchTranslate.translate(df)
      translations.put(id, t)
      out.put("ok", true)
      out.set[ObjectNode]("spec", t.spec)
    } catch {
      case u: Unsupported =>
        out.put("ok", false)
        out.put("reason", u.reason)
    }
    out.toString
  }
}
