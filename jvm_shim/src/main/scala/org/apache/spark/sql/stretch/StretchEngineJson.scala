package org.apache.spark.sql.stretch

import com.fasterxml.jackson.databind.JsonNode
import com.fasterxml.jackson.databind.node.{ArrayNode, ObjectNode}

import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.types._
import org.apache.spark.unsafe.types.{CalendarInterval, UTF8String}

import StretchAnalysis.{isFloating, isIntegral}
import StretchPlans.mapper

/** The expressions the engine evaluates itself (`host/columns.py`), as JSON in the spec: the
 * input projection (`prepare`) and the aggregation's result columns (`finish`), each None
 * where an expression is beyond what the engine knows (Spark then evaluates it). */
private[stretch] object StretchEngineJson {
  private val keyFieldTypes = Set[DataType](StringType, LongType, IntegerType, ShortType,
    ByteType, BooleanType, DateType, TimestampType)

  /** An expression of the engine's input as the engine evaluates it (host/columns.prepare, Arrow
   * compute over the base's columns, as Spark evaluates it), or None beyond this small set:
   * columns, literals, widening casts, coalesce, if, is null, and, or, not, comparisons of
   * integers or booleans (a `count_if`'s predicate), size, a timestamp plus a fixed number of
   * microseconds (a static session gap) and the composite key (Spark's unsafe row of its
   * fields, built byte for byte as Spark builds it). */
  def prepareJs(e: Expression): Option[JsonNode] = {
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
      case Or(x, y) => op("or", Seq(x, y))  // (three-valued, as Spark's: Arrow's Kleene and/or)
      case And(x, y) => op("and", Seq(x, y))
      case Not(x) => op("not", Seq(x))
      // (a mask of non-null flags, StretchAggregates.resolved: a sum of small literals that
      // cannot overflow; a user's + may, which Spark's ANSI mode raises on)
      case a: Add if flagMask(a) => op("add", Seq(a.left, a.right))
      // Comparisons of integers and booleans only: Arrow orders floats by IEEE (Spark: NaN
      // above all, equal to itself), and time types may differ in their time zone
      case b: BinaryComparison if comparable(b) => b match {
        case EqualTo(x, y) => op("eq", Seq(x, y))
        case LessThan(x, y) => op("lt", Seq(x, y))
        case LessThanOrEqual(x, y) => op("le", Seq(x, y))
        case GreaterThan(x, y) => op("gt", Seq(x, y))
        case GreaterThanOrEqual(x, y) => op("ge", Seq(x, y))
        case _ => None  // (<=>: null-safe)
      }
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

  private def flagMask(e: Expression): Boolean = e match {
    case If(_, Literal(0L, LongType), Literal(b: Long, LongType)) => b > 0 && b <= (1L << 14)
    case Add(x, y, _) => flagMask(x) && flagMask(y)
    case _ => false
  }

  private def comparable(b: BinaryComparison): Boolean =
    b.left.dataType == b.right.dataType &&
      (isIntegral(b.left.dataType) || b.left.dataType == BooleanType)

  private val finishTypes = Map[DataType, String](LongType -> "long", IntegerType -> "int",
    ShortType -> "short", ByteType -> "byte", DoubleType -> "double", FloatType -> "float",
    StringType -> "string", BooleanType -> "bool", DateType -> "date",
    TimestampType -> "timestamp", BinaryType -> "binary")

  /** The result expressions as the engine evaluates them itself (Arrow compute over its output
   * columns), for its own Delta append: one `{"name", "expr"}` per result column, or None when
   * an expression is beyond this small language (a decimal, say). */
  def finish(result: Seq[Expression], out: Seq[Attribute]): Option[ArrayNode] = {
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
      case BitwiseAnd(x, y) => node("bitand", js(x), js(y))
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