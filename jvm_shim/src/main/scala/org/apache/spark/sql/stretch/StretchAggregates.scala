package org.apache.spark.sql.stretch

import scala.collection.mutable.ArrayBuffer

import org.apache.spark.sql.catalyst.expressions._
import org.apache.spark.sql.catalyst.expressions.aggregate._
import org.apache.spark.sql.catalyst.optimizer.NormalizeNaNAndZero
import org.apache.spark.sql.catalyst.plans.logical.Aggregate
import org.apache.spark.sql.types._
import org.apache.spark.unsafe.types.UTF8String

import StretchAggregates._
import StretchAnalysis.{isFloating, isIntegral, strip, unsupported}

/** The aggregation's result columns over the engine's primitives (one translation's: its
 * `values` and `prims` grow as [[outs]] reads the aggregates), or the reason ([[Unsupported]])
 * an aggregate function, or a column type it takes, is not on the engine. `a`, `windowAttr`,
 * `keys`, `distincts`, `distinctCols` as [[StretchAnalysis]] read them. */
private[stretch] class StretchAggregates(a: Aggregate, windowAttr: Expression,
                                         keys: Seq[Expression],
                                         distincts: Seq[AggregateExpression],
                                         distinctCols: Seq[Expression]) {
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
    else PrimRef(prim("sum", Some(value(flag(anyNull(cs)), "long"))))
  // a row's "any of `cs` null"
  def anyNull(cs: Seq[Expression]): Expression = cs.map(IsNull(_): Expression).reduce(Or(_, _))
  // a row's 0 where `isNull`, else `bit`
  def flag(isNull: Expression, bit: Long = 1L): Expression =
    If(isNull, Literal(0L), Literal(bit))
  // "No row of the window has a non-null value of the columns" (`isNull`: a row's "any of them
  // null"): what sum, min, max (and first/last ignoring nulls, max_by/min_by) need to be null.
  // Read once every aggregate is ([[resolved]]), from the engine's primitives.
  case class NoNonNull(isNull: Expression) extends LeafExpression with Unevaluable {
    override def dataType: DataType = BooleanType
    override def nullable: Boolean = false
  }
  def noNonNull(cs: Seq[Expression]): Expression =
    if (cs.forall(!_.nullable)) EqualTo(PrimRef(prim("count", None)), Literal(0L))
    else NoNonNull(anyNull(cs))
  // null where `none` (a NoNonNull), else `v`; given a count of non-null rows, null where it is 0
  def orNull(none: Expression, v: Expression, t: DataType): Expression =
    If(if (none.dataType == BooleanType) none else EqualTo(none, Literal(0L)), Literal(null, t), v)
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
        evaluated(s, Seq(decimalSum(c, c.dataType.asInstanceOf[DecimalType]),
          noNonNull(Seq(c))).take(s.aggBufferAttributes.size))
      case s @ Sum(c, _) =>
        val k = numeric(c, "sum")
        val t = if (k == "long") LongType else DoubleType
        val sum = PrimRef(prim("sum", Some(value(Coalesce(Seq(Cast(c, t), zero(k))), k))))
        orNull(noNonNull(Seq(c)), Cast(sum, s.dataType), s.dataType)
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
        val nn = value(flag(IsNull(c)), "long")
        orNull(noNonNull(Seq(c)), cd.back(PrimRef(prim(fn, v, Some(nn)))), c.dataType)
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
        orNull(noNonNull(Seq(c)), cd.back(v), c.dataType)
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
          val nn = value(flag(IsNull(c)), "long")
          if (ignore) orNull(noNonNull(Seq(c)), cd.back(PrimRef(prim(s"${fn}_if", v, Some(nn)))),
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
            val taken = value(flag(IsNull(y)), "long")
            val k = value(Coalesce(Seq(key, zero(kind))), kind)
            v => PrimRef(byPrim(head, v, taken, k))
        }
        val v = cd.back(by(value(Coalesce(Seq(cd.engine, zero(cd.kind))), cd.kind)))
        val picked = if (!x.nullable) v else orNull(by(value(flag(IsNull(x)), "long")), v,
          x.dataType)
        orNull(noNonNull(Seq(y)), picked, x.dataType)
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
        val taken = Some(value(flag(IsNull(c)), "long"))
        StretchHll(PrimRef(prim(s"hll$p", hash, taken)), h.relativeSD)
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

  /** Each result column of the aggregation: its window, a key, or an expression over the
   * engine's primitives ([[PrimRef]]) and distinct aggregates ([[DistinctRef]]). */
  def outs(): Seq[Out] = resolved(a.aggregateExpressions.map { ne =>
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
  })

  /** `outs` with each [[NoNonNull]] read from the engine's primitives: from a sum of the
   * columns' non-null flags if there is one (count(x), avg(x)); else, for up to 15 of them, from
   * count(*)'s word if the aggregation has count(*) and no distinct aggregate (whose sub-rows'
   * words Spark adds up): count(*) becomes the engine's count_any of a mask of their flags, the
   * count in bits 0-47 and the or of the masks in bits 48-62, one word for all; else from a sum
   * of their flags of its own. */
  def resolved(outs: Seq[Out]): Seq[Out] = {
    val found = outs.flatMap {
      case AggOut(e) => e.collect { case NoNonNull(c) => c }
      case _ => Nil
    }
    val conds = found.foldLeft(Seq.empty[Expression]) { (seen, c) =>
      if (seen.exists(_.semanticEquals(c))) seen else seen :+ c }
    def summed(c: Expression): Int = {
      val v = values.indexWhere { case (e, k) => k == "long" && e.semanticEquals(flag(c)) }
      if (v < 0) -1 else prims.indexOf(("sum", Some(v), None))
    }
    val count = prims.indexOf(("count", None, None))
    val riding = if (count < 0 || distinctCols.nonEmpty) Seq.empty[Expression]
      else conds.filter(summed(_) < 0).take(15)
    if (riding.nonEmpty) {
      val mask = riding.zipWithIndex.map { case (c, j) => flag(c, 1L << j) }.reduce(Add(_, _))
      prims(count) = ("count_any", Some(value(mask, "long")), None)
    }
    def read(e: Expression): Expression = e.transformUp {
      case PrimRef(i) if riding.nonEmpty && i == count =>
        BitwiseAnd(PrimRef(i), Literal((1L << AnyShift) - 1))
      case NoNonNull(c) =>
        val bit = riding.indexWhere(_.semanticEquals(c))
        lazy val sum = summed(c)
        EqualTo(if (bit >= 0) BitwiseAnd(PrimRef(count), Literal(1L << (AnyShift + bit)))
          else PrimRef(if (sum >= 0) sum else prim("sum", Some(value(flag(c), "long")))),
          Literal(0L))
    }
    outs.map {
      case AggOut(e) => AggOut(read(e))
      case o => o
    }
  }
}

private[stretch] object StretchAggregates {
  // the engine's count_any: the count in bits 0-47, the or of the rows' flag masks above
  val AnyShift: Int = 48
  sealed trait Out
  case object WindowOut extends Out
  case class KeyOut(j: Int) extends Out
  case class AggOut(e: Expression) extends Out
}
