package org.apache.spark.sql.stretch

import java.util.concurrent.ConcurrentHashMap

import scala.collection.mutable.ArrayBuffer
import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.ObjectMapper
import com.fasterxml.jackson.databind.JsonNode
import com.fasterxml.jackson.databind.node.{ArrayNode, ObjectNode}

import org.apache.spark.{Partition, SparkContext, TaskContext}
import org.apache.spark.rdd.RDD
import org.apache.spark.sql.Row
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.analysis.{UnresolvedAlias, UnresolvedAttribute, UnresolvedFunction, UnsupportedOperationChecker}
import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.catalyst.expressions.aggregate._
import org.apache.spark.sql.catalyst.expressions.codegen.CodegenFallback
import org.apache.spark.sql.catalyst.plans.logical.{Aggregate, BinaryNode, EventTimeWatermark, Filter, Generate, LogicalPlan, Project}
import org.apache.spark.sql.catalyst.optimizer.NormalizeNaNAndZero
import org.apache.spark.sql.catalyst.types.DataTypeUtils
import org.apache.spark.sql.catalyst.util.HyperLogLogPlusPlusHelper
import org.apache.spark.sql.classic.{Dataset => ClassicDataset, SparkSession => ClassicSession}
import org.apache.spark.sql.catalyst.plans.physical.SinglePartition
import org.apache.spark.sql.catalyst.streaming.InternalOutputModes
import org.apache.spark.sql.execution.{BinaryExecNode, LogicalRDD, SparkPlan, SparkStrategy}
import org.apache.spark.sql.execution.streaming.operators.stateful.{SessionWindowStateStoreSaveExec, StateStoreSaveExec, StateStoreWriter}
import org.apache.spark.sql.execution.python.streaming.FlatMapGroupsInPandasWithStateExec
import org.apache.spark.sql.execution.streaming.runtime.StreamExecution
import org.apache.spark.sql.execution.streaming.state.{StateStoreId, StateStoreProviderId}
import org.apache.spark.sql.types._
import org.apache.spark.sql.util.CaseInsensitiveStringMap
import org.apache.spark.unsafe.types.{CalendarInterval, UTF8String}

/** How one aggregation runs on the engine (`regroup`: with a distinct aggregate). */
case class Translation(native: LogicalPlan, input: LogicalPlan, engineSchema: StructType,
                       result: Seq[Expression], spec: ObjectNode,
                       regroup: Option[Regroup] = None)

class Unsupported(val reason: String) extends Exception(reason)

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
      val t = translate(df)
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

  private def unsupported(reason: String): Nothing = throw new Unsupported(reason)

  private def strip(e: Expression): Expression = e match {
    case Alias(c, _) => strip(c)
    case UnresolvedAlias(c, _) => strip(c)
    case o => o
  }

  /** `window_time(w)` of a window column `w` (a window's event time, as Spark's
   * `ResolveWindowTime` computes it: its end minus one microsecond), with `w`'s watermark. */
  private def windowTime(w: Attribute): NamedExpression = {
    val fields = w.dataType match {
      case st: StructType => st.fields.map(f => (f.name, f.dataType)).toSeq
      case _ => Nil
    }
    if (fields != Seq("start" -> TimestampType, "end" -> TimestampType) ||
        !(w.metadata.contains(TimeWindow.marker) || w.metadata.contains(SessionWindow.marker))) {
      unsupported(s"window over '${w.name}', which is not a window column")
    }
    val meta = new MetadataBuilder().withMetadata(w.metadata).remove(TimeWindow.marker)
      .remove(SessionWindow.marker).build()
    val end = PreciseTimestampConversion(GetStructField(w, 1, Some("end")), TimestampType,
      LongType)
    Alias(PreciseTimestampConversion(Subtract(end, Literal(1L)), LongType, TimestampType),
      "__stretch_ts")(explicitMetadata = Some(meta))
  }

  private val integral = Set[DataType](ByteType, ShortType, IntegerType, LongType)
  private def isIntegral(t: DataType) = integral.contains(t)
  private def isFloating(t: DataType) = t == FloatType || t == DoubleType

  private def translate(df: ClassicDataset[Row]): Translation = {
    val qe = df.queryExecution
    val u = qe.logical match {
      case a: Aggregate => a
      case other => unsupported(s"the DataFrame's last step is ${other.nodeName}, not " +
        "groupBy(...).agg(...)")
    }
    val a = qe.analyzed match {
      case a: Aggregate => a
      case other => unsupported(s"the analyzed plan ends in ${other.nodeName}, not an Aggregate")
    }
    if (!a.isStreaming) unsupported("the DataFrame is not streaming")
    val x = u.child
    val windowAt = u.groupingExpressions.indexWhere { e => strip(e) match {
      case f: UnresolvedFunction => Set("window", "session_window", "window_time")
        .contains(f.nameParts.last.toLowerCase)
      case _ => false
    }}
    if (windowAt < 0) unsupported("no window(...) among the grouping columns (an aggregation " +
      "without event-time windows is not on the engine yet)")
    val fn = strip(u.groupingExpressions(windowAt)).asInstanceOf[UnresolvedFunction]
    val fname = fn.nameParts.last.toLowerCase
    val session = fname == "session_window"
    if (fname != "window" && !session) unsupported(s"$fname among the grouping columns")
    if (u.groupingExpressions.size != a.groupingExpressions.size) {
      unsupported("the grouping columns changed in analysis")
    }
    val durations = if (session) Nil else fn.arguments.drop(1).map {
      case Literal(v: UTF8String, _: StringType) => v.toString
      case other => unsupported(s"window duration ${other.sql} is not a literal interval string")
    }
    val resolver = df.sparkSession.sessionState.conf.resolver
    def column(e: Expression): Attribute = {
      val name = e match {
        case UnresolvedAttribute(parts) => parts.last
        case at: Attribute => at.name
        case other => unsupported(s"window over the expression ${other.sql} (use a column)")
      }
      x.output.find(at => resolver(at.name, name)).getOrElse(
        unsupported(s"window column '$name' is not a column of the aggregation's input"))
    }
    // The event time: a column of X, or the time of a window column of X (`window_time(w)`, or
    // `w` itself, as Spark reads a window struct: its end minus one microsecond, the watermark
    // delay of `w`): an aggregation of the windows another aggregation emitted
    val ts: NamedExpression = strip(fn.arguments.head) match {
      case f: UnresolvedFunction if f.nameParts.last.equalsIgnoreCase("window_time") &&
          f.arguments.size == 1 && !session =>
        windowTime(column(f.arguments.head))
      case e => column(e) match {
        case w if w.dataType.isInstanceOf[StructType] && !session => windowTime(w)
        case at => at
      }
    }
    val tsName = ts.name
    if (ts.dataType != TimestampType) {
      unsupported(s"window column '$tsName' has type ${ts.dataType.simpleString} (the engine " +
        "takes timestamp)")
    }
    if (!ts.metadata.contains(EventTimeWatermark.delayKey)) {
      unsupported(s"no withWatermark on the window column '$tsName'")
    }
    val delayMs = ts.metadata.getLong(EventTimeWatermark.delayKey)
    val windowAttr = a.groupingExpressions(windowAt)
    // a session window: each row's session end as Spark's analyzer computes it (ts + its gap,
    // a static or a per-row gap), from the projection it puts under the aggregation
    val sessionEnd: Option[Expression] = if (!session) None else {
      val id = windowAttr match {
        case at: Attribute => at.exprId
        case other => unsupported(s"session window as ${other.sql}")
      }
      val found = a.child.collect { case Project(list, _) => list.collect {
        case al @ Alias(CreateNamedStruct(Seq(_, _, _, end)), _) if al.exprId == id => end
      }}.flatten.headOption
      val end = found.getOrElse(unsupported("the session window's projection was not found " +
        "in the analyzed plan"))
      if (!end.deterministic || !end.references.subsetOf(x.outputSet)) {
        unsupported(s"session gap ${fn.arguments(1).sql}")
      }
      Some(end)
    }
    val keys = a.groupingExpressions.zipWithIndex.filter(_._2 != windowAt).map(_._1)
    keys.foreach { k =>
      if (!k.deterministic) unsupported(s"grouping column ${k.sql} is not deterministic")
      if (!k.references.subsetOf(x.outputSet)) unsupported(s"grouping column ${k.sql}")
    }
    // Distinct aggregates (count(DISTINCT c...), ...): the engine aggregates by the keys and
    // their columns, one sub-row per distinct value of a window and key; each batch's output
    // is aggregated again per window and key (Spark's own aggregation over the sub-rows, see
    // Regroup), which is exact where a window's sub-rows come out together: append (a window
    // is emitted when the watermark passes its end) and complete mode, not update mode
    val distincts = a.aggregateExpressions.flatMap(_.collect {
      case ae: AggregateExpression if ae.isDistinct => ae })
    val distinctCols: Seq[Expression] = distincts.headOption.map { d0 =>
      val cols = d0.aggregateFunction.children
      distincts.foreach { d =>
        val cs = d.aggregateFunction.children
        if (cs.size != cols.size || !cs.zip(cols).forall { case (p, q) => p.semanticEquals(q) }) {
          unsupported(s"${d0.sql} and ${d.sql}: distinct aggregates over different columns (the " +
            "engine keeps one sub-row per distinct value of one column set)")
        }
        d.aggregateFunction match {
          case _: Count | _: Sum | _: Average | _: Min | _: Max | _: CentralMomentAgg =>
          case f => unsupported(s"${d.sql}: ${f.prettyName} of distinct values is not on the " +
            "engine yet")
        }
      }
      if (session) unsupported(s"${d0.sql} over session windows (the rows of one distinct " +
        "value are sessions of their own)")
      cols.foreach { c =>
        if (!c.deterministic || !c.references.subsetOf(x.outputSet)) {
          unsupported(s"${d0.sql}: a distinct aggregate over ${c.sql}")
        }
      }
      cols
    }.getOrElse(Nil)

    // aggregates -> the engine's primitives over value columns
    val values = ArrayBuffer[(Expression, String)]()   // (expression, "long" | "double")
    // (fn, value index, take index): count|sum|min|max|first|last, or first_if|last_if (rows
    // whose take column is 0 skipped)
    val prims = ArrayBuffer[(String, Option[Int], Option[Int])]()
    def value(e: Expression, kind: String): Int = {
      val i = values.indexWhere { case (v, k) => k == kind && v.semanticEquals(e) }
      if (i >= 0) i else { values += ((e, kind)); values.size - 1 }
    }
    def prim(fn: String, v: Option[Int], take: Option[Int] = None): Int = {
      val i = prims.indexOf((fn, v, take))
      if (i >= 0) i else { prims += ((fn, v, take)); prims.size - 1 }
    }
    // A max_by/min_by by an exact ordering: the value's primitive (`fn`: max_by_l, ..., rows
    // whose take column is 0 skipped) and right after it the ordering's (`by<i>`, i the first's
    // index), which the engine keeps the extremum of
    def byPrim(fn: String, v: Int, take: Int, key: Int): Int = {
      val found = prims.indices.find(i => prims(i) == ((fn, Some(v), Some(take))) &&
        i + 1 < prims.size && prims(i + 1) == ((s"by$i", Some(key), None)))
      found.getOrElse {
        prims += ((fn, Some(v), Some(take)))
        prims += ((s"by${prims.size - 1}", Some(key), None))
        prims.size - 2
      }
    }
    // result expressions refer to prims by index; bound once the engine schema is known
    case class PrimRef(i: Int) extends LeafExpression with Unevaluable {
      override def dataType: DataType = prims(i) match {
        case ("count", _, _) => LongType
        case (f, _, _) if f.startsWith("hll") => BinaryType  // (Spark's HLL++ buffer words)
        case (_, Some(v), _) => values(v)._2 match {
          case "long" => LongType
          case "double" => DoubleType
          case _ => StringType
        }
        case _ => LongType
      }
      override def nullable: Boolean = false
    }
    def nonNull(cs: Seq[Expression]): PrimRef =
      if (cs.forall(!_.nullable)) PrimRef(prim("count", None))
      else PrimRef(prim("sum", Some(value(If(cs.map(IsNull(_): Expression).reduce(Or(_, _)),
        Literal(0L), Literal(1L)), "long"))))
    def orNull(nn: Expression, v: Expression, t: DataType): Expression =
      If(EqualTo(nn, Literal(0L)), Literal(null, t), v)
    def numeric(c: Expression, what: String): String =
      if (isIntegral(c.dataType)) "long" else if (isFloating(c.dataType)) "double"
      else unsupported(s"$what over ${c.dataType.simpleString} (the engine takes integral and " +
        "floating-point columns so far)")
    // The value a null of an engine column of `kind` counts as (its row is skipped or masked)
    def zero(kind: String): Literal = kind match {
      case "long" => Literal(0L)
      case "double" => Literal(0.0)
      case _ => Literal(UTF8String.EMPTY_UTF8, StringType)
    }
    // A column as the engine holds it (a long, a double, or a string the engine interns, for
    // the aggregates that only keep a value: `strings`), and its value back from that
    case class Coded(engine: Expression, kind: String, back: Expression => Expression)
    def coded(c: Expression, what: String, strings: Boolean = false): Coded = c.dataType match {
      case st: StringType if strings && st.supportsBinaryEquality =>
        Coded(c, "string", e => if (st == StringType) e else Cast(e, st))
      case t if isIntegral(t) => Coded(Cast(c, LongType), "long", Cast(_, t))
      case t if isFloating(t) => Coded(Cast(c, DoubleType), "double", Cast(_, t))
      case BooleanType => Coded(Cast(c, LongType), "long", Cast(_, BooleanType))
      case TimestampType => Coded(UnixMicros(c), "long", MicrosToTimestamp(_))
      case DateType => Coded(Cast(UnixDate(c), LongType), "long",
        e => DateFromUnixDate(Cast(e, IntegerType)))
      case d: DecimalType if d.precision <= 18 =>  // (its unscaled value fits a long)
        Coded(UnscaledValue(c), "long", MakeDecimal(_, d.precision, d.scale))
      case t => unsupported(s"$what over ${t.simpleString} (the engine takes numbers, booleans, " +
        "dates, timestamps and decimals of up to 18 digits)")
    }
    // An exact decimal sum: the unscaled values' high and low 32 bits summed apart (neither
    // sum can overflow a long), joined again in Spark's sum type (null beyond its precision)
    def decimalSum(c: Expression, t: DecimalType): StretchDecimalSum = {
      if (t.precision > 18) unsupported(s"a sum of ${t.simpleString} (the engine sums decimals " +
        "of up to 18 digits)")
      val u = Coalesce(Seq(UnscaledValue(c), Literal(0L)))
      val hi = PrimRef(prim("sum", Some(value(ShiftRight(u, Literal(32)), "long"))))
      val lo = PrimRef(prim("sum", Some(value(BitwiseAnd(u, Literal(0xFFFFFFFFL)), "long"))))
      StretchDecimalSum(hi, lo, DecimalType.bounded(t.precision + 10, t.scale))
    }
    // Spark's own final value of an aggregate from its buffer, the buffer as the engine has it
    def evaluated(f: DeclarativeAggregate, buffer: Seq[Expression]): Expression = {
      val by = f.aggBufferAttributes.map(_.exprId).zip(buffer).toMap
      f.evaluateExpression.transform { case at: AttributeReference if by.contains(at.exprId) =>
        by(at.exprId) }
    }

    // A distinct aggregate in a result expression: Spark's own function over the sub-rows
    case class DistinctRef(ae: AggregateExpression) extends LeafExpression with Unevaluable {
      override def dataType: DataType = ae.dataType
      override def nullable: Boolean = ae.nullable
    }
    val mergeable = Set("count", "sum", "min", "max")
    def aggregate(ae: AggregateExpression): Expression = {
      if (ae.filter.isDefined) unsupported(s"${ae.sql}: aggregate FILTER is not on the engine yet")
      if (ae.isDistinct) DistinctRef(ae)
      else if (distinctCols.isEmpty) plain(ae)
      else {  // beside a distinct aggregate: merged from the sub-rows' partial results
        val e = plain(ae)
        e.collect { case PrimRef(i) if !mergeable(prims(i)._1) => prims(i)._1 }.headOption
          .foreach { f => unsupported(s"${ae.sql} beside the distinct aggregate " +
            s"${distincts.head.sql} (its $f per distinct value does not merge; counts, sums, " +
            "min and max do)") }
        e
      }
    }
    def plain(ae: AggregateExpression): Expression = {
      ae.aggregateFunction match {
        case Count(cs) => nonNull(cs)
        case s @ Sum(c, _) if c.dataType.isInstanceOf[DecimalType] =>
          val nn = nonNull(Seq(c))
          evaluated(s, Seq(decimalSum(c, c.dataType.asInstanceOf[DecimalType]),
            EqualTo(nn, Literal(0L))).take(s.aggBufferAttributes.size))
        case s @ Sum(c, _) =>
          val k = numeric(c, "sum")
          val t = if (k == "long") LongType else DoubleType
          val sum = PrimRef(prim("sum", Some(value(Coalesce(Seq(Cast(c, t), zero(k))), k))))
          orNull(nonNull(Seq(c)), Cast(sum, s.dataType), s.dataType)
        case av @ Average(c, _) if c.dataType.isInstanceOf[DecimalType] =>
          evaluated(av, Seq(decimalSum(c, c.dataType.asInstanceOf[DecimalType]),
            nonNull(Seq(c))))
        case av @ Average(c, _) =>
          numeric(c, "avg")
          val sum = PrimRef(prim("sum", Some(value(Coalesce(Seq(Cast(c, DoubleType),
            Literal(0.0))), "double"))))
          val nn = nonNull(Seq(c))
          orNull(nn, Cast(Divide(sum, Cast(nn, DoubleType)), av.dataType), av.dataType)
        case m @ (_: Min | _: Max) if (m.children.head.dataType match {
            case st: StringType => st.supportsBinaryEquality
            case _ => false
          }) =>
          // a string's interned id; the engine compares strings by their order (it ranks
          // them by their UTF-8 bytes, as UTF8String compares them), a null row skipped
          val c = m.children.head
          val cd = coded(c, m.prettyName, strings = true)
          val fn = if (m.isInstanceOf[Min]) "min_if" else "max_if"
          val v = Some(value(Coalesce(Seq(cd.engine, zero("string"))), "string"))
          val nn = value(If(IsNull(c), Literal(0L), Literal(1L)), "long")
          orNull(nonNull(Seq(c)), cd.back(PrimRef(prim(fn, v, Some(nn)))), c.dataType)
        case m @ (_: Min | _: Max) =>
          val c = m.children.head
          val isMin = m.isInstanceOf[Min]
          val cd = coded(c, m.prettyName)
          val sentinel = (cd.kind, isMin) match {
            case ("long", true) => Literal(Long.MaxValue)
            case ("long", false) => Literal(Long.MinValue)
            case (_, true) => Literal(Double.PositiveInfinity)
            case (_, false) => Literal(Double.NegativeInfinity)
          }
          val v = PrimRef(prim(if (isMin) "min" else "max",
            Some(value(Coalesce(Seq(cd.engine, sentinel)), cd.kind))))
          orNull(nonNull(Seq(c)), cd.back(v), c.dataType)
        case f @ (_: First | _: Last) =>
          // the first (last) row of the window in event-time order (Spark's: in the order rows
          // reach it, which a shuffle leaves undefined); with ignoreNulls, of its non-null rows
          val (c, ignore, fn) = f match {
            case First(c, i) => (c, i, "first")
            case Last(c, i) => (c, i, "last")
          }
          val cd = coded(c, fn, strings = true)
          val v = Some(value(Coalesce(Seq(cd.engine, zero(cd.kind))), cd.kind))
          if (!c.nullable) cd.back(PrimRef(prim(fn, v)))
          else {
            val nn = value(If(IsNull(c), Literal(0L), Literal(1L)), "long")
            if (ignore) orNull(nonNull(Seq(c)), cd.back(PrimRef(prim(s"${fn}_if", v, Some(nn)))),
              c.dataType)
            else orNull(PrimRef(prim(fn, Some(nn))), cd.back(PrimRef(prim(fn, v))), c.dataType)
          }
        case mb @ (_: MaxBy | _: MinBy) =>
          // the value of the row with the largest (smallest) ordering, ties: the last (Spark's
          // predicate keeps the old one only when strictly better), a null ordering skipped
          val (x, y, fn) = mb match {
            case MaxBy(x, y) => (x, y, "max_by")
            case MinBy(x, y) => (x, y, "min_by")
          }
          val cd = coded(x, fn, strings = true) match {
            case Coded(e, "double", back) =>  // (its bits in the int slot)
              Coded(StretchDoubleBits(e), "long", b => back(StretchBitsDouble(b)))
            case other => other
          }
          // the primitive of the value with the extremum ordering of a value column
          val by: Int => PrimRef = y.dataType match {
            case IntegerType | ShortType | ByteType | DateType | TimestampType =>
              // the ordering as a double (exact for these types), a null one (NaN) skipped
              val yd = y.dataType match {
                case DateType => Cast(UnixDate(y), DoubleType)
                case TimestampType => Cast(UnixMicros(y), DoubleType)
                case _ => Cast(y, DoubleType)
              }
              val o = Some(value(Coalesce(Seq(yd, Literal(Double.NaN))), "double"))
              v => PrimRef(prim(fn, Some(v), o))
            case t =>
              // exactly: the ordering as a long that orders as Spark orders `t`, or a string the
              // engine interns and compares by its UTF-8 bytes, in a second primitive
              val (key, kind): (Expression, String) = t match {
                case LongType | BooleanType => (Cast(y, LongType), "long")
                case FloatType | DoubleType => (StretchDoubleOrder(Cast(y, DoubleType)), "long")
                case d: DecimalType if d.precision <= 18 => (UnscaledValue(y), "long")
                case st: StringType if st.supportsBinaryEquality => (y, "string")
                case _ => unsupported(s"$fn ordered by ${t.simpleString} (the engine orders by " +
                  "numbers, booleans, dates, timestamps, decimals of up to 18 digits and strings)")
              }
              val head = if (kind == "string") s"${fn}_s" else s"${fn}_l"
              val flag = value(If(IsNull(y), Literal(0L), Literal(1L)), "long")
              val k = value(Coalesce(Seq(key, zero(kind))), kind)
              v => PrimRef(byPrim(head, v, flag, k))
          }
          val v = cd.back(by(value(Coalesce(Seq(cd.engine, zero(cd.kind))), cd.kind)))
          val picked = if (!x.nullable) v else orNull(by(value(
            If(IsNull(x), Literal(0L), Literal(1L)), "long")), v, x.dataType)
          orNull(nonNull(Seq(y)), picked, x.dataType)
        case h: HyperLogLogPlusPlus =>
          // HLL++ as Spark's: the engine keeps the registers (Spark's buffer words, in a row of
          // its register pool) from each non-null row's xxhash64 with seed 42 (floats
          // normalized first, as Spark does); Spark's own estimate from them
          val c = h.child
          c.dataType match {
            case st: StringType if !st.supportsBinaryEquality =>
              unsupported(s"approx_count_distinct over ${st.simpleString} (a collation)")
            case _ =>
          }
          val p = math.ceil(2.0 * math.log(1.106 / h.relativeSD) / math.log(2.0)).toInt
          if (p > 18) unsupported(s"approx_count_distinct with rsd ${h.relativeSD} (HLL++ of " +
            s"2^$p registers; Spark's bias correction, and the engine, stop at 2^18: " +
            "rsd >= 0.0022)")
          val x = if (isFloating(c.dataType)) NormalizeNaNAndZero(c) else c
          val hash = Some(value(XxHash64(Seq(x), 42L), "long"))
          val flag = Some(value(If(IsNull(c), Literal(0L), Literal(1L)), "long"))
          StretchHll(PrimRef(prim(s"hll$p", hash, flag)), h.relativeSD)
        case CountIf(p) =>  // rows where p is true (null counts as false)
          PrimRef(prim("sum", Some(value(If(Coalesce(Seq(p, Literal(false))), Literal(1L),
            Literal(0L)), "long"))))
        case cm @ (VarianceSamp(_, _) | VariancePop(_, _) | StddevSamp(_, _) | StddevPop(_, _)) =>
          // from sum, sum of squares and count: m2 = sum(x^2) - sum(x)^2 / n (clamped at 0
          // against rounding), over n - 1 (samp) or n (pop); Spark's null (or NaN, with
          // spark.sql.legacy.statisticalAggregate) for a sample of one
          val c = cm.children.head
          numeric(c, cm.prettyName)
          val x = Cast(c, DoubleType)
          val s = PrimRef(prim("sum", Some(value(Coalesce(Seq(x, Literal(0.0))), "double"))))
          val q = PrimRef(prim("sum", Some(value(Coalesce(Seq(Multiply(x, x), Literal(0.0))),
            "double"))))
          val nn = nonNull(Seq(c))
          val n = Cast(nn, DoubleType)
          val m2raw = Subtract(q, Divide(Multiply(s, s), n))
          val m2 = If(LessThan(m2raw, Literal(0.0)), Literal(0.0), m2raw)
          val (samp, nullOnOne) = cm match {
            case VarianceSamp(_, z) => (true, z)
            case StddevSamp(_, z) => (true, z)
            case _ => (false, true)
          }
          val v0 = Divide(m2, if (samp) Subtract(n, Literal(1.0)) else n)
          val v = if (cm.isInstanceOf[StddevSamp] || cm.isInstanceOf[StddevPop]) Sqrt(v0) else v0
          val one = if (samp) If(EqualTo(nn, Literal(1L)),
            if (nullOnOne) Literal(null, DoubleType) else Literal(Double.NaN), v) else v
          orNull(nn, one, DoubleType)
        case other => unsupported(s"${other.prettyName}: this aggregate function is not on " +
          "the engine yet")
      }
    }

    sealed trait Out
    case object WindowOut extends Out
    case class KeyOut(j: Int) extends Out
    case class AggOut(e: Expression) extends Out
    val outs: Seq[Out] = a.aggregateExpressions.map { ne =>
      val e = strip(ne)
      if (e.semanticEquals(windowAttr)) WindowOut
      else keys.indexWhere(_.semanticEquals(e)) match {
        case j if j >= 0 => KeyOut(j)
        case _ => e match {
          case ae: AggregateExpression => AggOut(aggregate(ae))
          case other =>  // an expression over aggregates (and literals)
            val r = other.transformDown { case ae: AggregateExpression => aggregate(ae) }
            if (r.references.nonEmpty || !r.deterministic) {
              unsupported(s"the result column ${ne.sql} (an expression over grouping columns " +
                "is not on the engine yet)")
            }
            AggOut(r)
        }
      }
    }

    // the engine's key: an exploded array (multi-key), one plain column, or the encoded tuple
    if (prims.isEmpty) prim("count", None)  // (the engine keeps one aggregate at least)
    val normalized = (keys ++ distinctCols).map { c =>  // (grouped as Spark groups floats)
      if (isFloating(c.dataType)) NormalizeNaNAndZero(c) else c }
    val exploded: Option[(Expression, LogicalPlan)] = keys match {
      case _ if distinctCols.nonEmpty => None
      case Seq(k: Attribute) =>
        val below = x match {
          case Project(list, child) if list.forall(_.isInstanceOf[Attribute]) => child
          case o => o
        }
        below match {
          case Generate(Explode(arr), _, false, _, Seq(out), gchild)
              if out.exprId == k.exprId && ts.references.subsetOf(gchild.outputSet) &&
                (values.map(_._1) ++ sessionEnd).forall(_.references.subsetOf(gchild.outputSet)) =>
            arr.dataType match {
              case ArrayType(el, _) if el == StringType || isIntegral(el) => Some((arr, gchild))
              case _ => None
            }
          case _ => None
        }
      case _ => None
    }
    val (keyKind, keyExpr, keyType, base) = exploded match {
      case Some((arr, g)) =>
        val el = arr.dataType.asInstanceOf[ArrayType].elementType
        ("array", arr, if (el == StringType) "string" else "long", g)
      case None => normalized match {
        case Seq() => ("scalar", Literal(0L), "long", x)  // (the window alone: one key)
        case Seq(k) if !k.nullable && (k.dataType == StringType || isIntegral(k.dataType)) =>
          ("scalar", k, if (k.dataType == StringType) "string" else "long", x)
        case _ => ("scalar", StretchKeyEncode(normalized), "binary", x)
      }
    }
    val keyNamed: NamedExpression = keyExpr match {
      case at: Attribute => at
      case e => Alias(e, "__stretch_key")()
    }
    val valueNamed: Seq[NamedExpression] = values.zipWithIndex.map {
      case ((at: Attribute, _), _) => at
      case ((e, _), i) => Alias(e, s"__stretch_v$i")()
    }.toSeq
    val endNamed = sessionEnd.map(e => Alias(e, "__stretch_end")())
    val inputCols = (Seq[NamedExpression](ts, keyNamed) ++ endNamed ++ valueNamed)
    val names = inputCols.map(_.name)
    if (names.distinct.size != names.size) unsupported(s"input columns collide: $names")
    // The engine evaluates the input projection itself when every expression is one it knows
    // (prepareJs): the batch's input is then the base's own columns, which the engine may read
    // from the files (no Spark job); else Spark evaluates it.
    val rawCols = AttributeSet(inputCols.flatMap(_.references)).toSeq
    val prepare: Option[Seq[JsonNode]] =
      if (inputCols.forall(_.isInstanceOf[Attribute]) ||
          rawCols.map(_.name).distinct.size != rawCols.size) None
      else {
        val js = inputCols.map {
          case at: Attribute => prepareJs(at)
          case Alias(e, _) => prepareJs(e)
          case _ => None
        }
        if (js.exists(_.isEmpty)) None else Some(js.map(_.get))
      }
    val input = if (prepare.isDefined) Project(rawCols, base) else Project(inputCols, base)

    // the engine's output: window, key, one column per primitive (named as the engine names them)
    val valueName = valueNamed.map(_.name)
    val primNames = prims.map {
      case ("count", _, _) => "count"
      case (f, Some(v), Some(o)) => s"$f(${valueName(v)}, ${valueName(o)})"
      case (f, Some(v), None) => s"$f(${valueName(v)})"
      case (f, None, _) => f
    }
    val windowType = StructType(Seq(StructField("start", TimestampType),
      StructField("end", TimestampType)))
    val engineKeyType: DataType = keyType match {
      case "string" => StringType
      case "long" => LongType
      case _ => BinaryType
    }
    val engineSchema = StructType(Seq(StructField("window", windowType),
      StructField("key", engineKeyType)) ++ prims.indices.map(i =>
      StructField(primNames(i), PrimRef(i).dataType)))
    val keyStruct = StructType(normalized.zipWithIndex.map { case (k, j) =>
      StructField(s"_$j", k.dataType, k.nullable) })
    val keyRef = BoundReference(1, engineKeyType, nullable = true)
    def castTo(e: Expression, t: DataType): Expression = if (e.dataType == t) e else Cast(e, t)
    val result: Seq[Expression] = outs.zip(a.output).map {
      case (WindowOut, at) => castTo(BoundReference(0, windowType, nullable = true), at.dataType)
      case (KeyOut(j), at) => keyType match {
        case "binary" => GetStructField(StretchKeyDecode(keyRef, keyStruct), j)
        case _ => castTo(keyRef, at.dataType)
      }
      case (AggOut(e), _) => e.transform {
        case PrimRef(i) => BoundReference(2 + i, PrimRef(i).dataType, nullable = true)
      }
    }
    // With a distinct aggregate: the engine's rows as sub-rows (window, key columns, distinct
    // columns, primitives), aggregated again per window and key: a primitive by its merge (sums
    // and counts add up, min and max), a distinct aggregate as Spark's own function over the
    // sub-rows' distinct columns (one sub-row per distinct value: count skips the null one)
    val regroup: Option[Regroup] = if (distinctCols.isEmpty) None else {
      val decoded = StretchKeyDecode(keyRef, keyStruct)
      val sub = Seq[Expression](BoundReference(0, windowType, nullable = true)) ++
        normalized.indices.map(j => GetStructField(decoded, j)) ++
        prims.indices.map(i => BoundReference(2 + i, PrimRef(i).dataType, nullable = true))
      val w = AttributeReference("window", windowType)()
      val fields = normalized.zipWithIndex.map { case (c, j) =>
        AttributeReference(s"_$j", c.dataType)() }
      val ps = prims.indices.map(i => AttributeReference(s"_p$i", PrimRef(i).dataType)())
      val (keyAttrs, distinctAttrs) = fields.splitAt(keys.size)
      def merged(i: Int): Expression = (prims(i)._1 match {
        case "min" => Min(ps(i))
        case "max" => Max(ps(i))
        case _ => Sum(ps(i))  // (count, sum)
      }).toAggregateExpression()
      val named = outs.zip(a.output).map {
        case (WindowOut, at) => Alias(castTo(w, at.dataType), at.name)()
        case (KeyOut(j), at) => Alias(keyAttrs(j), at.name)()
        case (AggOut(e), at) => Alias(e.transform {
          case PrimRef(i) => merged(i)
          case DistinctRef(ae) => ae.copy(isDistinct = false, aggregateFunction =
            ae.aggregateFunction.withNewChildren(distinctAttrs).asInstanceOf[AggregateFunction])
        }, at.name)()
      }
      Some(Regroup(sub, w +: (fields ++ ps), w +: keyAttrs, named))
    }

    val spec = mapper.createObjectNode()
    spec.put("ts_column", ts.name)
    spec.put("delay_ms", delayMs)
    spec.put("key_kind", keyKind)
    spec.put("key_column", keyNamed.name)
    spec.put("key_type", keyType)
    val w = spec.putArray("window")
    durations.foreach(d => w.add(d))
    endNamed.foreach(e => spec.put("session_end", e.name))
    val aggs = spec.putArray("aggs")
    prims.foreach { case (f, v, take) =>
      val p = aggs.addArray()
      p.add(f)
      v match { case Some(i) => p.add(valueName(i)); case None => p.addNull() }
      take.foreach(i => p.add(valueName(i)))
    }
    val vt = spec.putObject("value_types")
    values.zipWithIndex.foreach { case ((_, k), i) => vt.put(valueName(i), k) }
    val outNames = spec.putArray("output_names")
    primNames.foreach(n => outNames.add(n))
    if (regroup.isEmpty) finish(result, a.output).foreach(f => spec.set[JsonNode]("finish", f))
    else spec.put("regroup", true)
    prepare.foreach { js =>
      val arr = spec.putArray("prepare")
      inputCols.zip(js).foreach { case (c, j) =>
        arr.add(mapper.createObjectNode().put("name", c.name).set[JsonNode]("expr", j)) }
    }
    Translation(a, input, engineSchema, result, spec, regroup)
  }

  private val keyFieldTypes = Set[DataType](StringType, LongType, IntegerType, ShortType,
    ByteType, BooleanType, DateType, TimestampType)

  /** An expression of the engine's input as the engine evaluates it (host/columns.prepare, Arrow
   * compute over the base's columns, as Spark evaluates it), or None beyond this small set:
   * columns, literals, widening casts, coalesce, if, is null, or, size, a timestamp plus a
   * fixed number of microseconds (a static session gap) and the composite key
   * (Spark's unsafe row of its fields, built byte for byte as Spark builds it). */
  private def prepareJs(e: Expression): Option[JsonNode] = {
    def op(name: String, args: Seq[Expression]): Option[JsonNode] = {
      val js = args.map(prepareJs)
      if (js.exists(_.isEmpty)) None else {
        val o = mapper.createObjectNode()
        val a = o.putArray(name)
        js.foreach(x => a.add(x.get))
        Some(o)
      }
    }
    e match {
      case at: AttributeReference => Some(mapper.createObjectNode().put("col", at.name))
      case Literal(v, t) if finishTypes.contains(t) && (v == null || v.isInstanceOf[Long] ||
          v.isInstanceOf[Int] || v.isInstanceOf[Double] || v.isInstanceOf[Boolean] ||
          v.isInstanceOf[UTF8String]) =>
        val o = mapper.createObjectNode().put("type", finishTypes(t))
        v match {
          case null => o.putNull("lit")
          case x: UTF8String => o.put("lit", x.toString)
          case x: Long => o.put("lit", x)
          case x: Int => o.put("lit", x)
          case x: Double => o.put("lit", x)
          case x: Boolean => o.put("lit", x)
        }
        Some(o)
      case Cast(c, t, _, _) if c.dataType == t || (t == LongType &&
          (isIntegral(c.dataType) || c.dataType == BooleanType)) ||
          (t == DoubleType && (isIntegral(c.dataType) || isFloating(c.dataType))) =>
        prepareJs(c).map(j => mapper.createObjectNode().put("type", finishTypes(t))
          .set[JsonNode]("cast", j))
      case KnownNullable(c) => prepareJs(c)
      case PreciseTimestampConversion(c, _, t) =>  // (the same microseconds, as another type)
        prepareJs(c).map(j => mapper.createObjectNode().put("type", finishTypes(t))
          .set[JsonNode]("cast", j))
      case TimestampAddInterval(c, gap, _) if gap.foldable && c.dataType == TimestampType =>
        gap.eval() match {  // a session's end: a fixed gap of microseconds (no days, months)
          case i: CalendarInterval if i.months == 0 && i.days == 0 =>
            prepareJs(c).map(j => mapper.createObjectNode().put("us", i.microseconds)
              .set[JsonNode]("addus", j))
          case _ => None
        }
      case Coalesce(cs) => op("coalesce", cs)
      case If(p, x, y) => op("if", Seq(p, x, y))
      case IsNull(c) => op("isnull", Seq(c))
      case Or(x, y) => op("or", Seq(x, y))
      case Size(c, legacy) => op("size", Seq(c)).map(_.asInstanceOf[ObjectNode]
        .put("legacy", legacy))
      case StretchDoubleBits(c) => op("bits", Seq(c))
      case StretchDoubleOrder(c) => op("dorder", Seq(c))
      case StretchKeyEncode(cs) if cs.forall(c => keyFieldTypes.contains(c.dataType)) =>
        op("row", cs).map { o =>
          val types = o.asInstanceOf[ObjectNode].putArray("types")
          cs.foreach(c => types.add(finishTypes(c.dataType)))
          o
        }
      case _ => None
    }
  }

  private val finishTypes = Map[DataType, String](LongType -> "long", IntegerType -> "int",
    ShortType -> "short", ByteType -> "byte", DoubleType -> "double", FloatType -> "float",
    StringType -> "string", BooleanType -> "bool", DateType -> "date",
    TimestampType -> "timestamp", BinaryType -> "binary")

  /** The result expressions as the engine evaluates them itself (Arrow compute over its output
   * columns), for its own Delta append: one `{"name", "expr"}` per result column, or None when
   * an expression is beyond this small language (a decimal, say). */
  private def finish(result: Seq[Expression], out: Seq[Attribute]): Option[ArrayNode] = {
    def node(op: String, args: Option[JsonNode]*): Option[JsonNode] =
      if (args.exists(_.isEmpty)) None else {
        val o = mapper.createObjectNode()
        val a = o.putArray(op)
        args.foreach(x => a.add(x.get))
        Some(o)
      }
    def typed(op: String, t: DataType, arg: Option[JsonNode]): Option[JsonNode] =
      (finishTypes.get(t), arg) match {
        case (Some(n), Some(x)) =>
          val o = mapper.createObjectNode()
          o.set[JsonNode](op, x)
          o.put("type", n)
          Some(o)
        case _ => None
      }
    def js(e: Expression): Option[JsonNode] = e match {
      case BoundReference(i, _, _) => Some(mapper.createObjectNode().put("ref", i))
      case Literal(null, t) => typed("lit", t, Some(mapper.getNodeFactory.nullNode()))
      case Literal(v: Long, t) => typed("lit", t, Some(mapper.getNodeFactory.numberNode(v)))
      case Literal(v: Int, t) => typed("lit", t, Some(mapper.getNodeFactory.numberNode(v)))
      case Literal(v: Double, t) => typed("lit", t, Some(mapper.getNodeFactory.numberNode(v)))
      case Cast(c, t, _, _) => typed("cast", t, js(c))
      case If(p, x, y) => node("if", js(p), js(x), js(y))
      case EqualTo(x, y) => node("eq", js(x), js(y))
      case Divide(x, y, _) => node("div", js(x), js(y))
      case Add(x, y, _) => node("add", js(x), js(y))
      case Subtract(x, y, _) => node("sub", js(x), js(y))
      case Multiply(x, y, _) => node("mul", js(x), js(y))
      case LessThan(x, y) => node("lt", js(x), js(y))
      case GreaterThan(x, y) => node("gt", js(x), js(y))
      case Sqrt(x) => node("sqrt", js(x))
      case StretchBitsDouble(x) => node("unbits", js(x))
      case Literal(v: Boolean, t) => typed("lit", t, Some(mapper.getNodeFactory.booleanNode(v)))
      case GetStructField(StretchKeyDecode(BoundReference(1, _, _), schema), j, _) =>
        finishTypes.get(schema(j).dataType).map(t => mapper.createObjectNode()
          .put("keyfield", j).put("fields", schema.length).put("type", t))
      case _ => None
    }
    val cols = result.zip(out).map { case (e, at) =>
      js(e).map(j => mapper.createObjectNode().put("name", at.name).set[JsonNode]("expr", j))
    }
    if (cols.exists(_.isEmpty)) None else {
      val arr = mapper.createArrayNode()
      cols.foreach(c => arr.add(c.get))
      Some(arr)
    }
  }
}
