package org.apache.spark.sql.stretch

import java.io.{BufferedInputStream, BufferedOutputStream, DataInputStream, DataOutputStream, IOException}
import java.net.{InetSocketAddress, StandardProtocolFamily, UnixDomainSocketAddress}
import java.nio.channels.{Channels, SocketChannel}
import java.nio.charset.StandardCharsets
import javax.crypto.Mac
import javax.crypto.spec.SecretKeySpec

import com.fasterxml.jackson.databind.ObjectMapper
import com.fasterxml.jackson.databind.node.ObjectNode

/**
 * One connection to a host engine's receiver: over a Unix domain socket (`path`, on its own
 * host), or over TCP (`tcp://address:port`, from another host), answering the engine's
 * challenge with the application's `secret` first (spark_stretch/protocol/auth.py: the engine
 * sends a magic line and a 16-byte nonce, the client HMAC-SHA256(secret, magic + nonce)).
 *
 * Framing (spark_stretch/protocol/framing.py): a request is a 4-byte big-endian length and a UTF-8
 * JSON header (`{"v": 1, "op": ..., ...}`, the messages of spark_stretch/protocol/messages.py),
 * optionally followed by an Arrow IPC stream; a reply is a framed JSON header (`{"ok": true, ...}`
 * or `{"ok": false, "code": "...", "error": "..."}`), optionally followed by an Arrow IPC stream.
 */
class ReceiverClient(val path: String, timeoutMs: Int, secret: String = null)
  extends AutoCloseable {
  private val tcp = path.startsWith("tcp://")
  private val channel: SocketChannel = {
    val ch = SocketChannel.open(if (tcp) StandardProtocolFamily.INET else StandardProtocolFamily.UNIX)
    try {
      if (tcp) {
        val i = path.lastIndexOf(':')
        ch.connect(new InetSocketAddress(path.substring(6, i), path.substring(i + 1).toInt))
      } else ch.connect(UnixDomainSocketAddress.of(path))
    } catch {
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
  if (tcp) authenticate()

  private def authenticate(): Unit = {
    if (secret == null) throw new IOException(s"stretch receiver at '$path' is a TCP endpoint: " +
      "the data source's 'secret' option is required")
    val magic = ReceiverClient.AuthMagic
    val head = new Array[Byte](magic.length + 16)
    try withTimeout(in.readFully(head)) catch {
      case e: java.io.EOFException => throw new IOException(s"stretch receiver at '$path' sent " +
        "no challenge", e)
    }
    if (!java.util.Arrays.equals(head.take(magic.length), magic)) {
      throw new IOException(s"'$path' is not a stretch engine (no stretch challenge)")
    }
    val mac = Mac.getInstance("HmacSHA256")
    mac.init(new SecretKeySpec(secret.getBytes(StandardCharsets.UTF_8), "HmacSHA256"))
    out.write(mac.doFinal(head))
    out.flush()
  }

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
  /** spark_stretch.protocol.auth.MAGIC */
  val AuthMagic: Array[Byte] = "STRETCH-AUTH-1\n".getBytes(StandardCharsets.US_ASCII)
  def header(op: String, stream: String): ObjectNode = {
    val h = mapper.createObjectNode()
    h.put("v", ProtocolVersion)
    h.put("op", op)
    h.put("stream", stream)
    h
  }
}
