package org.apache.spark.sql.stretch

import java.io.{File, IOException, RandomAccessFile}
import java.nio.charset.StandardCharsets
import java.nio.file.Files
import java.security.MessageDigest
import java.util.concurrent.TimeUnit

import scala.jdk.CollectionConverters._

import org.apache.spark.SparkContext

/**
 * Starts the spark-stretch host engine on executor hosts, from the executors (as Ray on Spark
 * starts its nodes): a small Spark job with one task per host, placed there by its preferred
 * location, each of which starts `python -m spark_stretch.host.daemon` on its own host unless
 * the application's engine already runs there, and answers where it listens.
 *
 * The task does not stay: the engine outlives it (and the executor that started it, which may be
 * lost while other executors of the host still use the engine), living on a lease the driver
 * renews; it exits when the driver stops it, or stops renewing. So no core of the host is held
 * by a launcher task. Per host, `<dir>/stretch-engine-<app>-<host>/` (`<dir>`: the executor's own
 * `java.io.tmpdir` unless the driver names one; `/tmp/stretch-engine-<hash>/` where that path is
 * too long for a Unix socket's address, [[engineDir]]) holds the engine's Unix
 * socket, its `engine.json` (pid, TCP address: how a second launcher finds it), its log and a
 * lock that lets one launcher at a time start it; the engine removes the directory when it exits.
 *
 * The engine runs from the executors' Python environment (`command`'s first word is the Python
 * PySpark's workers run): a host where it cannot start fails the launcher with an error naming
 * the host and what is missing there (the Python, a module, the package's version).
 */
object StretchHosts {

  /**
   * Make sure the application's engine runs on each of `hosts` (as executors name them).
   * `command` starts one (`--socket`, `--tcp` and `--lease` are added); the secret is written
   * to its standard input. `baseDir` "" is each executor's own `java.io.tmpdir`. Returns, per
   * host in order, `host|socket|tcp://address:port|pid`.
   */
  def launch(sc: SparkContext, hosts: Array[String], command: Array[String], secret: String,
             baseDir: String, lease: Double, timeoutMs: Int): Array[String] = {
    val app = sc.applicationId.replaceAll("[^A-Za-z0-9_.-]", "_")
    val cmd = command.toSeq
    val deadline = System.nanoTime() + timeoutMs * 1000000L
    val started = scala.collection.mutable.Map[String, String]()
    // A task placed on another host (Spark's delay scheduling gives a preference up after
    // spark.locality.wait, e.g. while the host's executor unpacks the job's archives) answers
    // that it missed, without failing: the hosts it missed get another job, until the deadline.
    var missing = hosts.toSeq
    while (missing.nonEmpty) {
      val rdd = sc.makeRDD(missing.map(h => (h, Seq(h))))
      sc.setJobDescription(s"spark-stretch: start the host engines on ${missing.mkString(", ")}")
      val lines = try {
        rdd.mapPartitions { it =>
          val host = it.next()
          Iterator(if (StretchOptions.hostOf() != host) s"$Missed$host"
                   else ensure(host, app, cmd, secret, baseDir, lease, timeoutMs))
        }.collect()
      } finally sc.setJobDescription(null)
      lines.filterNot(_.startsWith(Missed)).foreach(l => started(l.split('|')(0)) = l)
      missing = missing.filterNot(started.contains)
      if (missing.nonEmpty) {
        val live = sc.statusTracker.getExecutorInfos.map(_.host).toSet
        val gone = missing.filterNot(live.contains)
        if (gone.nonEmpty) {  // (a lost host: the caller asks Spark for the hosts again)
          throw new IOException(s"the stretch engine launcher found no executor on " +
            s"${gone.mkString(", ")}")
        }
        if (System.nanoTime() > deadline) {
          throw new IOException(s"the stretch engine launcher could not run on " +
            s"${missing.mkString(", ")} within $timeoutMs ms (its tasks ran on other hosts)")
        }
        Thread.sleep(500)
      }
    }
    hosts.map(started)
  }

  private val Missed = "MISSED|"

  /** The longest socket path used: a Unix socket's address holds 107 bytes on Linux (108 with
   * its terminating zero), a few less elsewhere. */
  val MaxSocketPath = 100

  /**
   * The engine's directory on `host`: `<base>/stretch-engine-<app>-<host>`, or, when its socket
   * would not fit a Unix socket's address ([[MaxSocketPath]]), `/tmp/stretch-engine-<hash>`
   * (16 hex digits of that path's SHA-256: every launcher of the host finds the same). An
   * executor's `java.io.tmpdir` can be long: YARN's is inside the container's directory.
   */
  def engineDir(base: String, app: String, host: String): File = {
    val safe = host.replaceAll("[^A-Za-z0-9_.-]", "_")
    val dir = new File(base, s"stretch-engine-$app-$safe")
    if (new File(dir, "engine.sock").getPath.getBytes(StandardCharsets.UTF_8).length
        <= MaxSocketPath) {
      dir
    } else {
      val hash = MessageDigest.getInstance("SHA-256")
        .digest(dir.getPath.getBytes(StandardCharsets.UTF_8)).take(8).map("%02x".format(_))
        .mkString
      new File("/tmp", s"stretch-engine-$hash")
    }
  }

  private def alive(pid: Long): Boolean =
    java.lang.ProcessHandle.of(pid).map[Boolean](_.isAlive).orElse(false)

  /** On `host` (this executor's): the running engine's line, or a new engine's. */
  def ensure(host: String, app: String, cmd: Seq[String], secret: String, baseDir: String,
             lease: Double, timeoutMs: Int): String = {
    val base = if (baseDir.isEmpty) System.getProperty("java.io.tmpdir") else baseDir
    val dir = engineDir(base, app, host)
    dir.mkdirs()
    val lock = new RandomAccessFile(new File(dir, "launch.lock"), "rw")
    try {
      val held = lock.getChannel.lock()
      try {
        val info = new File(dir, "engine.json")
        if (info.exists()) {
          val node = StretchPlans.mapper.readTree(info)
          if (alive(node.get("pid").asLong())) {
            return Seq(host, node.get("socket").asText(), node.get("tcp").asText(),
              node.get("pid").asText()).mkString("|")
          }
        }
        start(host, dir, cmd, secret, lease, timeoutMs)
      } finally held.release()
    } finally lock.close()
  }

  private def start(host: String, dir: File, cmd: Seq[String], secret: String, lease: Double,
                    timeoutMs: Int): String = {
    val socket = new File(dir, "engine.sock").getPath
    val out = new File(dir, "engine.out")
    // (what an engine killed with -9 left: its successor listens on the same socket path)
    Seq("engine.sock", "engine.json", "engine.out").foreach(f => new File(dir, f).delete())
    val pb = new ProcessBuilder((cmd ++ Seq("--socket", socket, "--tcp", host,
      "--lease", lease.toString)).asJava)
    pb.environment().put("SPARK_STRETCH_PROCESS", "host")
    pb.environment().remove("PYSPARK_GATEWAY_PORT")
    pb.redirectOutput(out)
    pb.redirectError(new File(dir, "engine.log"))
    val proc = try pb.start() catch {
      case e: IOException =>
        remove(dir)
        throw new IOException(cannotStart(host, cmd.head, s"its Python cannot be run here " +
          s"(${e.getMessage})") + ". " + Remedy, e)
    }
    val deadline = System.nanoTime() + timeoutMs * 1000000L
    var ready = false
    // Whatever ends the wait but READY (a failed start, the timeout, or this task interrupted
    // because another host's failure cancelled the launch job) leaves no process or directory.
    try {
      try {
        proc.getOutputStream.write((secret + "\n").getBytes(StandardCharsets.UTF_8))
        proc.getOutputStream.close()
      } catch {
        // (a Python that exits at once, one without the package, can be gone before its secret
        // is written: the JDK has closed its stdin. Its log says why, read below.)
        case e: IOException => if (!proc.waitFor(2, TimeUnit.SECONDS)) throw e
      }
      while (System.nanoTime() < deadline) {
        val lines = if (out.exists()) Files.readAllLines(out.toPath).asScala else Nil
        lines.find(_.startsWith("READY ")) match {
          case Some(line) =>
            val parts = line.split(" ")
            val tcp = parts(1)
            val pid = proc.pid()
            val json = StretchPlans.mapper.createObjectNode()
            json.put("pid", pid).put("socket", socket).put("tcp", tcp)
            val tmp = new File(dir, ".engine.json.tmp")
            StretchPlans.mapper.writeValue(tmp, json)
            Files.move(tmp.toPath, new File(dir, "engine.json").toPath,
              java.nio.file.StandardCopyOption.ATOMIC_MOVE)
            ready = true
            return Seq(host, socket, tcp, pid.toString).mkString("|")
          case None =>
            if (!proc.isAlive) {
              val log = new File(dir, "engine.log")
              val err = if (log.exists()) new String(Files.readAllBytes(log.toPath),
                StandardCharsets.UTF_8).takeRight(4000) else ""
              throw new IOException(whyNotStarted(host, cmd.head, proc.exitValue(), err))
            }
            Thread.sleep(20)
        }
      }
      throw new IOException(s"the stretch host engine on $host was not ready within $timeoutMs ms")
    } finally {
      if (!ready) {
        proc.destroyForcibly()
        remove(dir)
      }
    }
  }

  /** The engine's directory and what is in it (it has no subdirectories). */
  private def remove(dir: File): Unit = {
    Option(dir.listFiles()).foreach(_.foreach(_.delete()))
    dir.delete()
  }

  /** What to do when the executors' Python lacks the package (the README's "On a cluster"). */
  val Remedy: String = "Install spark-stretch, with its dependencies, in the Python environment " +
    "the executors run (pip install on each node, or a packed virtualenv shipped with " +
    "spark-submit --archives and spark.pyspark.python; see the README's 'On a cluster')"

  private def cannotStart(host: String, python: String, what: String): String =
    s"spark-stretch cannot start its engine on executor host $host: $what (the executors' " +
      s"Python: $python)"

  private val NoModule = """No module named '?([A-Za-z0-9_.]+)'?""".r

  /** The engine's process ended before it was ready: why, from its log. */
  def whyNotStarted(host: String, python: String, status: Int, log: String): String = {
    val own = log.linesIterator.find(_.startsWith("STRETCH-ERROR ")).map(_.stripPrefix(
      "STRETCH-ERROR "))
    (own, NoModule.findFirstMatchIn(log)) match {
      case (Some(reason), _) => cannotStart(host, python, reason) + ". " + Remedy
      case (None, Some(m)) =>
        cannotStart(host, python, s"no module named '${m.group(1)}' there") + ". " + Remedy
      case _ => s"the stretch host engine on $host exited with status $status before it " +
        s"was ready: $log"
    }
  }
}
