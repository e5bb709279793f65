package org.apache.spark.sql.stretch

import org.apache.spark.sql.Row
import org.apache.spark.sql.catalyst.analysis.{UnresolvedAlias, UnresolvedAttribute, UnresolvedFunction}
import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.catalyst.expressions.aggregate._
import org.apache.spark.sql.catalyst.plans.logical.{Aggregate, EventTimeWatermark, Join, LogicalPlan,
  Project}
import org.apache.spark.sql.classic.{Dataset => ClassicDataset}
import org.apache.spark.sql.types._
import org.apache.spark.unsafe.types.UTF8String

/** Why the engine cannot run an aggregation: `stretch(df)` then leaves it to Spark, and says
 * this reason. [[StretchPlans.analyze]] catches it; each reason is decided where it is thrown:
 * the query's shape (its window, event time and watermark, grouping columns, distinct
 * aggregates) in [[StretchAnalysis]], each aggregate function and the column types it takes,
 * and the result columns, in [[StretchAggregates]], the engine's input columns in
 * [[StretchTranslate]]. */
class Unsupported(val reason: String) extends Exception(reason)

/** The user's windowed aggregation as [[StretchAnalysis]] read it: `a` the analyzed aggregation
 * over `x` (its input), the window's `durations` (none for a session window), the event time
 * `ts` with its watermark delay, the window's grouping expression, each row's session end (a
 * session window), the other grouping columns `keys`, and the distinct aggregates with the
 * columns they share. */
private[stretch] case class Analyzed(a: Aggregate, x: LogicalPlan, durations: Seq[String],
                                     ts: NamedExpression, delayMs: Long, windowAttr: Expression,
                                     sessionEnd: Option[Expression], keys: Seq[Expression],
                                     distincts: Seq[AggregateExpression],
                                     distinctCols: Seq[Expression])

/** Reads the user's `groupBy(window(ts, ...), keys...).agg(...)`: the window, its event time
 * and watermark, the grouping columns and the distinct aggregates, or the reason
 * ([[Unsupported]]) the engine cannot run it. The aggregates themselves are read by
 * [[StretchAggregates]]. */
private[stretch] object StretchAnalysis {
  def unsupported(reason: String): Nothing = throw new Unsupported(reason)

  def strip(e: Expression): Expression = e match {
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
  def isIntegral(t: DataType) = integral.contains(t)
  def isFloating(t: DataType) = t == FloatType || t == DoubleType

  /** The shape of `df`'s aggregation, or [[Unsupported]]. */
  def analyze(df: ClassicDataset[Row]): Analyzed = {
    val qe = df.queryExecution
    val u = qe.logical match {
      case a: Aggregate => a
      case other =>
        // (say what the query is when it is not an aggregation: a join, or a stateless query)
        val what = other.collectFirst { case j: Join => j }.map { j =>
          ": a join of " + (if (j.left.isStreaming && j.right.isStreaming) "two streams"
            else "a stream and a table") + s" (${j.joinType.sql.toLowerCase}; the engine " +
            "runs aggregations, Spark runs the join)"
        }.getOrElse(if (other.exists(_.isInstanceOf[Aggregate])) "" else
          ": a stateless query (no aggregation: nothing for the engine to keep)")
        unsupported(s"the DataFrame's last step is ${other.nodeName}, not " +
          s"groupBy(...).agg(...)$what")
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
    Analyzed(a, x, durations, ts, delayMs, windowAttr, sessionEnd, keys, distincts, distinctCols)
  }
}
