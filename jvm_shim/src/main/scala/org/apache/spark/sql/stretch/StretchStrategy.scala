package org.apache.spark.sql.stretch

import org.apache.spark.sql.catalyst.expressions.{Attribute, AttributeSet}
import org.apache.spark.sql.catalyst.plans.logical.{BinaryNode, LogicalPlan, UpdateEventTimeWatermarkColumn}
import org.apache.spark.sql.execution.{ProjectExec, SparkPlan, SparkStrategy}

/**
 * `spark_stretch.stretch(df)`: a native streaming aggregation, run by the host engine inside
 * Spark's own plan.
 *
 * [[StretchPlans.analyze]] reads the user's `groupBy(window(ts, ...), keys...).agg(...)` and
 * either says why the engine cannot run it (the caller then leaves it to Spark) or keeps a
 * [[Translation]]: the engine's input (a projection of the aggregation's input: the event time,
 * one key column and the aggregates' inputs) and how the engine's output rows become the
 * aggregation's rows. [[StretchPlans.mark]] returns the DataFrame with a [[StretchMarker]] over
 * the aggregation: a node with two children, Spark's own aggregation (planned as Spark plans it,
 * so the micro-batch has its state info, output mode, watermarks and no-data batches exactly as
 * natively) and the engine's input. [[StretchStrategy]] plans it as [[StretchExec]], whose
 * `doExecute` hands the batch's input to the driver's handler (Python, over py4j), which ingests
 * it, steps the engine and answers where the output is offered; the exec then reads it on the
 * executors and projects it into the aggregation's rows (`out`, the aggregation's columns). The
 * chain under it never runs. Over windows it is a stand-in: an aggregation of the event time
 * alone over the engine's input, which gives the batch the same state info, output mode,
 * watermark and no-data batches, and costs Spark little to optimize and plan each batch (the
 * windows' expansion of the real chain cost 25-35 ms a batch). Over session windows it is
 * Spark's own chain, so that Spark's checks of session windows run as natively (update mode,
 * which Spark refuses for them, is refused when the query starts, with Spark's own error).
 * A query may hold several markers (a union of two aggregations, one aggregating another's
 * windows): each exec steps its own engine query, with Spark's own watermark of the batch.
 * With a distinct aggregate, the engine aggregates per window, key and distinct value, and
 * [[Regroup]] aggregates each batch's rows again per window and key.
 *
 * The `applyInPandasWithState` drop-in ([[StretchPlans.markGrouped]]) is the same marker over
 * Spark's own `FlatMapGroupsInPandasWithState` and its input: the batch's time and watermarks
 * are those Spark gives that operator, the engine runs the user's function on the input's rows,
 * and the exec reads the function's rows back as they are.
 */
case class StretchMarker(id: String, native: LogicalPlan, input: LogicalPlan,
                         keep: Seq[Attribute], out: Seq[Attribute]) extends BinaryNode {
  // `keep`, every column of both children, is what the marker refers to: the optimizer must
  // prune neither the aggregation's results (the exec fills them by position) nor the input.
  override def left: LogicalPlan = native
  override def right: LogicalPlan = input
  override def output: Seq[Attribute] = out
  // (the aggregation's columns the children do not have: a key column is also an input one,
  // and must stay a reference, or the optimizer prunes it from the input)
  override def producedAttributes: AttributeSet = AttributeSet(out) -- AttributeSet(keep)
  override protected def withNewChildrenInternal(
      newLeft: LogicalPlan, newRight: LogicalPlan): StretchMarker =
    copy(native = newLeft, input = newRight)
}

object StretchStrategy extends SparkStrategy {
  override def apply(plan: LogicalPlan): Seq[SparkPlan] = plan match {
    case StretchMarker(id, native, input, _, out) =>
      StretchExec(id, planLater(native), planLater(input), out) :: Nil
    case StretchStateMarker(key, name, child) =>
      StretchStateExec(key, name, StretchState.stateInfo(key), planLater(child)) :: Nil
    // transformWithState's eventTimeColumnName over the marker: the column (with its watermark
    // delay in its metadata, which the operators after it read) passes through. Spark's own
    // exec would check each row against the late-events watermark that its rule gives only to
    // an exec right over Spark's operator; the engine's rows are the processor's, unchecked.
    case u @ UpdateEventTimeWatermarkColumn(_, _, m: StretchMarker) =>
      ProjectExec(u.output, planLater(m)) :: Nil
    case _ => Nil
  }
}
