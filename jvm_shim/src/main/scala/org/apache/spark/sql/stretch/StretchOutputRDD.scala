package org.apache.spark.sql.stretch

import org.apache.spark.{Partition, SparkContext, TaskContext}
import org.apache.spark.rdd.RDD
import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.{Attribute, Expression, NamedExpression, UnsafeProjection}
import org.apache.spark.sql.catalyst.plans.logical.Aggregate
import org.apache.spark.sql.catalyst.plans.physical.SinglePartition
import org.apache.spark.sql.classic.{Dataset => ClassicDataset, SparkSession => ClassicSession}
import org.apache.spark.sql.execution.LogicalRDD

/** The engine's output of one micro-batch, read on the host of its receiver. */
class StretchOutputRDD(sc: SparkContext, parts: Array[StretchInputPartition],
                       factory: StretchReaderFactory) extends RDD[InternalRow](sc, Nil) {
  private case class Part(index: Int, p: StretchInputPartition) extends Partition

  override protected def getPartitions: Array[Partition] =
    parts.zipWithIndex.map { case (p, i) => Part(i, p): Partition }

  override protected def getPreferredLocations(split: Partition): Seq[String] =
    split.asInstanceOf[Part].p.preferredLocations().toSeq

  override def compute(split: Partition, context: TaskContext): Iterator[InternalRow] = {
    val reader = factory.createReader(split.asInstanceOf[Part].p)
    context.addTaskCompletionListener[Unit](_ => reader.close())
    new Iterator[InternalRow] {
      private var ready = false
      private var more = false
      override def hasNext: Boolean = {
        if (!ready) { more = reader.next(); ready = true }
        more
      }
      override def next(): InternalRow = {
        if (!hasNext) throw new NoSuchElementException("end of the stretch output")
        ready = false
        reader.get()
      }
    }
  }
}

/** An aggregation with a distinct aggregate: the engine aggregates per window, key and distinct
 * value; each batch's rows (`sub`, over the engine's row: the sub-rows `subAttrs`) are then
 * aggregated per window and key (`grouping`) into the aggregation's columns (`named`) by
 * Spark's own aggregation, in the batch. */
case class Regroup(sub: Seq[Expression], subAttrs: Seq[Attribute], grouping: Seq[Attribute],
                   named: Seq[NamedExpression]) {
  /** The aggregation's rows of one batch, from the engine's (in one partition). */
  def apply(spark: ClassicSession, engine: RDD[InternalRow]): RDD[InternalRow] = {
    val exprs = sub
    val rows = engine.coalesce(1).mapPartitionsWithIndexInternal { (i, it) =>
      val proj = UnsafeProjection.create(exprs)
      proj.initialize(i)
      it.map(proj)
    }
    val plan = Aggregate(grouping, named, LogicalRDD(subAttrs, rows, SinglePartition)(spark))
    ClassicDataset.ofRows(spark, plan).queryExecution.toRdd
  }
}
