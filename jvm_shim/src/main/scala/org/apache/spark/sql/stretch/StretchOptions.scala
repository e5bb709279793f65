package org.apache.spark.sql.stretch

import java.util.Locale

import org.apache.spark.sql.util.CaseInsensitiveStringMap

/**
 * Options of the `stretch` data source, validated once on the driver.
 *
 * `endpoints` names the host engines' receivers as `host=/path/to/socket` entries separated by
 * commas (a bare `/path` means "this host"); an entry `host=/path|tcp://address:port` is also
 * reachable from other hosts over TCP, with the application's `secret` (the engine's challenge,
 * spark_stretch/protocol/auth.py). Writers send each partition to the receiver of the
 * executor's own host, or with `route` (the name of the last column, an array of indices into
 * `endpoints`) each row to each host it lists; readers get `splits` input partitions per
 * receiver (each a contiguous slice of the offered rows, so several cores of the host read and
 * write them), placed on its host.
 */
case class StretchOptions(
    endpoints: Seq[(String, String)],
    stream: String,
    batchRows: Int,
    timeoutMs: Int,
    splits: Int = 1,
    secret: String = null,
    route: String = null) extends Serializable {

  /** The endpoint entry of `host`, or the only one when there is a single endpoint (one-host
   * setups). */
  def entryFor(host: String): (String, String) = {
    endpoints.find(_._1 == host).orElse {
      endpoints.find(e => e._1 == "*" || e._1.isEmpty)
    }.orElse {
      if (endpoints.size == 1) Some(endpoints.head) else None
    }.getOrElse(throw new IllegalArgumentException(
      s"No stretch receiver for host '$host'. The option '${StretchOptions.ENDPOINTS}' lists " +
        endpoints.map(_._1).mkString("[", ", ", "]") + "; every executor host needs one."))
  }

  /** Where to reach an endpoint entry from this JVM: its Unix socket on its own host (or when
   * it has no TCP address), else its TCP address. */
  def address(entry: (String, String)): String = {
    val (host, value) = entry
    value.indexOf('|') match {
      case -1 => value
      case i if host == StretchOptions.hostOf() => value.substring(0, i)
      case i => value.substring(i + 1)
    }
  }

  /** A client of an endpoint entry (or of a bare address). */
  def client(entry: (String, String)): ReceiverClient =
    new ReceiverClient(address(entry), timeoutMs, secret)
}

object StretchOptions {
  val ENDPOINTS = "endpoints"
  val STREAM = "stream"
  val BATCH_ROWS = "batchRows"
  val TIMEOUT_MS = "timeoutMs"
  val SPLITS = "splits"
  val SECRET = "secret"
  val ROUTE = "route"
  val DEFAULT_BATCH_ROWS = 65536
  val DEFAULT_TIMEOUT_MS = 120000
  private val StreamName = "[A-Za-z0-9_.:-]{1,200}".r

  private def invalid(value: String, option: String, must: String): Nothing =
    throw new IllegalArgumentException(s"Invalid value '$value'. The option '$option' must be $must.")

  private def positiveInt(options: CaseInsensitiveStringMap, key: String, default: Int): Int = {
    val raw = options.get(key)
    if (raw == null) default
    else {
      val v = try raw.trim.toInt catch { case _: NumberFormatException => invalid(raw, key, "a positive integer") }
      if (v <= 0) invalid(raw, key, "a positive integer")
      v
    }
  }

  def parse(options: CaseInsensitiveStringMap): StretchOptions = {
    val rawEndpoints = options.get(ENDPOINTS)
    if (rawEndpoints == null || rawEndpoints.trim.isEmpty) {
      throw new IllegalArgumentException(
        s"The option '$ENDPOINTS' is required: the receiver sockets as 'host=/path' entries " +
          "separated by commas (spark_stretch sets it for you).")
    }
    val endpoints = rawEndpoints.split(",").toSeq.map(_.trim).filter(_.nonEmpty).map { e =>
      val (host, path) = e.indexOf('=') match {
        case -1 => ("*", e)
        case i => (e.substring(0, i).trim, e.substring(i + 1).trim)
      }
      val (unix, tcp) = path.indexOf('|') match {
        case -1 => (path, "")
        case i => (path.substring(0, i), path.substring(i + 1))
      }
      if (!unix.startsWith("/") || !(tcp.isEmpty || tcp.matches("tcp://[^:/|,]+:[0-9]{1,5}"))) {
        invalid(rawEndpoints, ENDPOINTS,
          "a list of 'host=/absolute/socket/path[|tcp://address:port]' entries")
      }
      if (tcp.nonEmpty && options.get(SECRET) == null) {
        throw new IllegalArgumentException(s"The option '$SECRET' is required with a TCP " +
          s"endpoint in '$ENDPOINTS' (spark_stretch sets it for you).")
      }
      (host, path)
    }
    val stream = Option(options.get(STREAM)).getOrElse("default")
    if (StreamName.unapplySeq(stream).isEmpty) {
      invalid(stream, STREAM, "1 to 200 characters from [A-Za-z0-9_.:-]")
    }
    StretchOptions(endpoints, stream,
      positiveInt(options, BATCH_ROWS, DEFAULT_BATCH_ROWS),
      positiveInt(options, TIMEOUT_MS, DEFAULT_TIMEOUT_MS),
      positiveInt(options, SPLITS, 1),
      options.get(SECRET),
      options.get(ROUTE))
  }

  def hostOf(): String = {
    val env = org.apache.spark.SparkEnv.get
    if (env != null && env.blockManager != null && env.blockManager.blockManagerId != null) {
      env.blockManager.blockManagerId.host
    } else {
      java.net.InetAddress.getLocalHost.getHostName.toLowerCase(Locale.ROOT)
    }
  }
}
