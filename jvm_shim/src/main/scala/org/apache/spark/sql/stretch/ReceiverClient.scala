package org.apache.spark.sql.stretch

import java.io.{BufferedInputStream, BufferedOutputStream, DataInputStream, DataOutputStream, IOException}
import java.net.{StandardProtocolFamily, UnixDomainSocketAddress}
import java.nio.channels.{Channels, SocketChannel}
import java.nio.charset.StandardCharsets

import com.fasterxml.jackson.databind.ObjectMapper
import com.fasterxml.jackson.databind.node.ObjectNode

/**
 * One connection to a host engine's receiver over a Unix domain socket.
 *
 * Framing (spark_stretch/protocol/framing.py): a request is a 4-byte big-endian length and a UTF-8
 * JSON header (`{"v": 1, "op": ..., ...}`, the messages of spark_stretch/protocol/messages.py),
 * optionally followed by an Arrow IPC stream; a reply is a framed JSON header (`{"ok": true, ...}`
 * or `{"ok": false, "code": "...", "error": "..."}`), optionally followed by an Arrow IPC stream.
 */
class ReceiverClient(val path: String, timeoutMs: Int) extends AutoCloseable {
  private val channel: SocketChannel = {
    val ch = SocketChannel.open(StandardProtocolFamily.UNIX)
    try ch.connect(UnixDomainSocketAddress.of(path)) catch {
      case e: IOException =>
        ch.close()
        throw new IOException(s"Cannot reach the stretch receiver at '$path' (is the host engine " +
          s"running? it is started by spark_stretch): ${e.getMessage}", e)
    }
    ch
  }
  // Blocking channels: a read with no reply ever would hang, so a watchdog closes the socket.
  val out = new DataOutputStream(new BufferedOutputStream(Channels.newOutputStream(channel), 1 << 16))
  val in = new DataInputStream(new BufferedInputStream(Channels.newInputStream(channel), 1 << 16))

  def send(header: ObjectNode): Unit = {
    val bytes = ReceiverClient.mapper.writeValueAsBytes(header)
    out.writeInt(bytes.length)
    out.write(bytes)
    out.flush()
  }

  /** Reads a reply header, throwing the receiver's error as an IOException naming the endpoint. */
  def reply(): ObjectNode = {
    val n = withTimeout(in.readInt())
    val bytes = new Array[Byte](n)
    in.readFully(bytes)
    val node = ReceiverClient.mapper.readTree(new String(bytes, StandardCharsets.UTF_8))
      .asInstanceOf[ObjectNode]
    if (!node.path("ok").asBoolean(false)) {
      throw new IOException(s"stretch receiver at '$path' failed (" + node.path("code").asText("?") +
        "): " + node.path("error").asText("?"))
    }
    node
  }

  private def withTimeout[T](body: => T): T = {
    val timer = new java.util.Timer("stretch-receiver-timeout", true)
    timer.schedule(new java.util.TimerTask { def run(): Unit = channel.close() }, timeoutMs.toLong)
    try body catch {
      case e: java.nio.channels.AsynchronousCloseException =>
        throw new IOException(s"stretch receiver at '$path' did not answer within $timeoutMs ms", e)
    } finally timer.cancel()
  }

  def request(header: ObjectNode): ObjectNode = { send(header); reply() }

  override def close(): Unit = channel.close()
}

object ReceiverClient {
  val mapper = new ObjectMapper()
  /** The protocol version this shim speaks (PROTOCOL_VERSION of spark_stretch.protocol.messages). */
  val ProtocolVersion = 1
  def header(op: String, stream: String): ObjectNode = {
    val h = mapper.createObjectNode()
    h.put("v", ProtocolVersion)
    h.put("op", op)
    h.put("stream", stream)
    h
  }
}
