package org.apache.spark.sql.stretch

import java.util

import scala.jdk.CollectionConverters._

import org.apache.arrow.vector.ipc.ArrowStreamReader

import org.apache.spark.sql.connector.catalog.{SupportsRead, SupportsWrite, Table, TableCapability, TableProvider}
import org.apache.spark.sql.connector.expressions.Transform
import org.apache.spark.sql.connector.read.ScanBuilder
import org.apache.spark.sql.connector.write.{LogicalWriteInfo, WriteBuilder}
import org.apache.spark.sql.sources.DataSourceRegister
import org.apache.spark.sql.types.StructType
import org.apache.spark.sql.util.{ArrowUtils, CaseInsensitiveStringMap}

/**
 * The `stretch` data source: moves Arrow record batches between Spark executors and the
 * spark-stretch engine running on the same host.
 *
 * {{{
 *   df.write.format("stretch").mode("append")
 *     .option("endpoints", "host=/tmp/stretch.sock").option("stream", "in").save()
 *   spark.read.format("stretch").option("endpoints", ...).option("stream", "out").load()
 * }}}
 */
class StretchDataSource extends TableProvider with DataSourceRegister {
  override def shortName(): String = "stretch"

  override def supportsExternalMetadata(): Boolean = true

  /** The schema of what the receiver offers on `stream` (asked of the first endpoint). */
  override def inferSchema(options: CaseInsensitiveStringMap): StructType = {
    val opts = StretchOptions.parse(options)
    val client = opts.client(opts.endpoints.head)
    try {
      client.request(ReceiverClient.header("schema", opts.stream))
      val reader = new ArrowStreamReader(client.in, ArrowUtils.rootAllocator)
      try ArrowUtils.fromArrowSchema(reader.getVectorSchemaRoot.getSchema) finally reader.close()
    } finally client.close()
  }

  override def getTable(
      schema: StructType,
      partitioning: Array[Transform],
      properties: util.Map[String, String]): Table = {
    StretchTable(schema, StretchOptions.parse(new CaseInsensitiveStringMap(properties)))
  }
}

case class StretchTable(tableSchema: StructType, opts: StretchOptions)
  extends Table with SupportsRead with SupportsWrite {

  override def name(): String = s"stretch:${opts.stream}"

  override def schema(): StructType = tableSchema

  override def capabilities(): util.Set[TableCapability] = Set(
    TableCapability.BATCH_READ, TableCapability.BATCH_WRITE, TableCapability.ACCEPT_ANY_SCHEMA
  ).asJava

  override def newScanBuilder(options: CaseInsensitiveStringMap): ScanBuilder =
    new StretchScanBuilder(tableSchema, opts)

  override def newWriteBuilder(info: LogicalWriteInfo): WriteBuilder =
    new StretchWriteBuilder(info.schema(), opts, info.queryId())
}
