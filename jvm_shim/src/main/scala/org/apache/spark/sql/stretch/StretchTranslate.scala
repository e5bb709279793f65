package org.apache.spark.sql.stretch

import com.fasterxml.jackson.databind.JsonNode
import com.fasterxml.jackson.databind.node.ObjectNode

import org.apache.spark.sql.Row
import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.catalyst.expressions.aggregate._
import org.apache.spark.sql.catalyst.optimizer.NormalizeNaNAndZero
import org.apache.spark.sql.catalyst.plans.logical.{Generate, LogicalPlan, Project}
import org.apache.spark.sql.classic.{Dataset => ClassicDataset}
import org.apache.spark.sql.types._

import StretchAggregates._
import StretchAnalysis.{isFloating, isIntegral, unsupported}
import StretchEngineJson.{finish, prepareJs}
import StretchPlans.mapper

/** How one aggregation runs on the engine (`regroup`: with a distinct aggregate). */
case class Translation(native: LogicalPlan, input: LogicalPlan, engineSchema: StructType,
                       result: Seq[Expression], spec: ObjectNode,
                       regroup: Option[Regroup] = None)

/** `df`'s aggregation as the engine runs it ([[StretchPlans.analyze]]): [[StretchAnalysis]]
 * reads its shape, [[StretchAggregates]] its aggregates as the engine's primitives; this puts
 * together the engine's key and input (the input projection, which the engine may evaluate
 * itself: [[StretchEngineJson]]), its output schema, the expressions that make the
 * aggregation's rows from the engine's ([[Regroup]] with a distinct aggregate) and the spec
 * Python starts the engine query with. */
private[stretch] object StretchTranslate {
  def translate(df: ClassicDataset[Row]): Translation = {
    val Analyzed(a, x, durations, ts, delayMs, windowAttr, sessionEnd, keys, distincts,
      distinctCols) = StretchAnalysis.analyze(df)
    val aggregates = new StretchAggregates(a, windowAttr, keys, distincts, distinctCols)
    import aggregates.{prim, prims, values, PrimRef, DistinctRef}
    val outs = aggregates.outs()

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
        // (one key column, nulls and all: its values are the engine's keys, the null key
        // one of its own; several columns are encoded as one binary key)
        case Seq(k) if k.dataType == StringType || isIntegral(k.dataType) =>
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
    spec.put("key_nullable", keyKind == "scalar" && keyType != "binary" && keyExpr.nullable)
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
}
