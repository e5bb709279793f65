"""A real Apache Kafka broker on this machine, for tests and benchmarks.

:class:`KafkaBroker` starts one KRaft node (broker and controller in one JVM, as Kafka's
quick-start does) bound to ``127.0.0.1`` on free ports, with its data in a directory of its own,
and always stops it: its JVM ended (SIGTERM, then SIGKILL), its directory removed. The broker's
jars (``org.apache.kafka:kafka_2.13``, :data:`KAFKA_PACKAGE`) are resolved once from Maven
Central by Spark's own Ivy into the spark-stretch cache, as Delta's are; Scala's library and
the logging binding come from pyspark's own jars (Spark's Ivy leaves them out).

Topics are made and written with ``confluent_kafka`` (librdkafka; the ``test`` extra). Spark
reads them with its own connector, ``spark-sql-kafka-0-10`` (:data:`SPARK_KAFKA_PACKAGE`),
given to :func:`spark_stretch.session` in ``spark.jars.packages`` (Delta kept beside it).

The broker speaks PLAINTEXT on loopback with no authentication: a fixture for this machine's
tests, not a server to expose.

Examples
--------
::

    from spark_stretch.testing.kafka import KafkaBroker, SPARK_KAFKA_PACKAGE

    with KafkaBroker() as kafka:
        kafka.create_topic("events", partitions=2)
        kafka.produce("events", [(b"k", b'{"x": 1}')])
        spark = spark_stretch.session(conf={"spark.jars.packages": SPARK_KAFKA_PACKAGE})
        df = (spark.readStream.format("kafka")
              .option("kafka.bootstrap.servers", kafka.bootstrap)
              .option("subscribe", "events").option("startingOffsets", "earliest").load())
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..driver.shim import cache_dir
from ..driver.session import package_jars
from .cluster import free_port
from .processes import end_process_groups

__all__ = ["KafkaBroker", "KAFKA_PACKAGE", "SPARK_KAFKA_PACKAGE", "broker_classpath", "send"]

#: The broker: Apache Kafka 4.x (KRaft only; Java 17).
KAFKA_PACKAGE = "org.apache.kafka:kafka_2.13:4.4.0"
#: Spark's Kafka source and sink, for ``spark.jars.packages``.
SPARK_KAFKA_PACKAGE = "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0"

_LOG4J = """\
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
"""


def broker_classpath(ivy: Optional[Path] = None) -> List[str]:
    """The jars of a Kafka broker (:data:`KAFKA_PACKAGE` with its dependencies, resolved once
    into ``ivy``, default ``<spark-stretch cache>/kafka-broker``), then Scala's library and an
    SLF4J 2 binding to Log4j from pyspark's jars (Kafka's own SLF4J 1.7 API is left out)."""
    import pyspark

    jars = [j for j in package_jars(Path(ivy or cache_dir() / "kafka-broker"), [KAFKA_PACKAGE])
            if "slf4j-api" not in Path(j).name]
    spark_jars = Path(pyspark.__file__).parent / "jars"
    extra = [p for pattern in ("scala-library-*.jar", "slf4j-api-*.jar",
                               "log4j-slf4j2-impl-*.jar")
             for p in sorted(map(str, spark_jars.glob(pattern)))]
    return jars + extra


def send(producer, topic: str, value: bytes, **kw) -> None:
    """``producer.produce(topic, value=value, **kw)`` (a ``confluent_kafka.Producer``), waiting
    while its local queue is full."""
    while True:
        try:
            producer.produce(topic, value=value, **kw)
            return
        except BufferError:  # the local queue is full: let it drain
            producer.poll(0.05)


def cluster_id() -> str:
    """A random KRaft cluster id: a UUID in URL-safe base64, never starting with ``-``.

    Kafka's own ``Uuid.randomUuid`` draws again for the same reason: an id starting with ``-``
    (one in 64) is read by the storage tool's argument parser as an option, and formatting fails.
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class KafkaBroker:
    """One KRaft Kafka node on ``host`` (broker and controller), started on ``__enter__`` and
    stopped on ``__exit__``.

    Parameters
    ----------
    host : str
        The address both listeners bind; clients use :attr:`bootstrap`.
    partitions : int
        Partitions of a topic made without a count (:meth:`create_topic`).
    heap : str
        The broker JVM's ``-Xmx``.
    start_timeout : float
        Seconds to wait for the broker to serve metadata; past it, an error naming its log.

    Notes
    -----
    Topics are not created on first use (``auto.create.topics.enable=false``): a misspelt topic
    fails the query instead of reading an empty new one.
    """

    def __init__(self, host: str = "127.0.0.1", partitions: int = 2, heap: str = "512m",
                 start_timeout: float = 120):
        self.host = host
        self.partitions = partitions
        self.heap = heap
        self.start_timeout = start_timeout
        self.port = free_port(host)
        self.controller_port = free_port(host)
        self.bootstrap = f"{host}:{self.port}"
        self._dir: Optional[Path] = None
        self._proc: Optional[subprocess.Popen] = None

    @property
    def log(self) -> Path:
        """The broker's log file (warnings and errors, and its start)."""
        assert self._dir is not None, "the broker is not started"
        return self._dir / "server.log"

    def _properties(self) -> str:
        h = self.host
        return "\n".join([
            "process.roles=broker,controller", "node.id=1",
            f"controller.quorum.voters=1@{h}:{self.controller_port}",
            f"listeners=PLAINTEXT://{h}:{self.port},CONTROLLER://{h}:{self.controller_port}",
            f"advertised.listeners=PLAINTEXT://{h}:{self.port}",
            "controller.listener.names=CONTROLLER", "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={self._dir / 'data'}", f"num.partitions={self.partitions}",
            "auto.create.topics.enable=false",
            # keep every record: a test's record times may lie far in the past
            "log.retention.ms=-1", "log.retention.bytes=-1",
            # one node: every internal topic with one replica
            "offsets.topic.replication.factor=1", "offsets.topic.num.partitions=1",
            "transaction.state.log.replication.factor=1", "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0", ""])

    def _java(self, main: str, *args: str) -> List[str]:
        java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") \
            else "java"
        return [str(java), f"-Xmx{self.heap}", "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={self._dir / 'log4j2.properties'}",
                "-cp", ":".join(self._classpath), main, *args]

    def __enter__(self) -> "KafkaBroker":
        self._classpath = broker_classpath()
        self._dir = Path(tempfile.mkdtemp(prefix="stretch-kafka-"))
        try:
            props = self._dir / "server.properties"
            props.write_text(self._properties())
            (self._dir / "log4j2.properties").write_text(_LOG4J.format(log=self.log))
            fmt = subprocess.run(self._java("kafka.tools.StorageTool", "format",
                                            f"--cluster-id={cluster_id()}", "-c", str(props)),
                                 capture_output=True, text=True, timeout=120)
            if fmt.returncode != 0:
                raise RuntimeError("formatting the Kafka broker's storage failed:\n"
                                   + (fmt.stdout + fmt.stderr)[-3000:])
            out = open(self._dir / "stdout.log", "wb")
            self._proc = subprocess.Popen(self._java("kafka.Kafka", str(props)), stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            out.close()
            self._wait()
        except BaseException:
            self.stop()
            raise
        return self

    def _admin(self):
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap})

    def _wait(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        admin = None
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the Kafka broker exited ({self._proc.returncode}) at its "
                                   f"start: see {self._dir}/stdout.log and {self.log}:\n"
                                   + self._tail())
            try:
                # (the port first: librdkafka would log each refused connection)
                socket.create_connection((self.host, self.port), timeout=1).close()
                admin = admin or self._admin()
                if admin.list_topics(timeout=2).brokers:
                    return
            except Exception:  # (OSError, KafkaException: not up yet)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Kafka broker did not start in {self.start_timeout:.0f} "
                                   f"s: see {self.log}:\n" + self._tail())
            time.sleep(0.3)

    def _tail(self) -> str:
        text = ""
        for f in (self._dir / "stdout.log", self._dir / "server.log"):
            if f.exists():
                text += f.read_text(errors="replace")[-2000:]
        return text

    def create_topic(self, name: str, partitions: Optional[int] = None,
                     config: Optional[Dict[str, str]] = None) -> None:
        """Make topic ``name`` with ``partitions`` partitions (default :attr:`partitions`), one
        replica and the topic settings ``config`` (e.g. ``{"message.timestamp.type":
        "LogAppendTime"}``); an error if it exists or the broker refuses it."""
        from confluent_kafka.admin import NewTopic

        admin = self._admin()  # (held until the result: a collected client cancels it)
        topic = NewTopic(name, partitions or self.partitions, 1, config=dict(config or {}))
        futures = admin.create_topics([topic], operation_timeout=30)
        futures[name].result(timeout=60)

    def produce(self, topic: str, records: Iterable[Tuple[Optional[bytes], bytes]],
                timestamps: Optional[Sequence[int]] = None, partition: Optional[int] = None
                ) -> int:
        """Write ``records`` (key, value) to ``topic``, with record times ``timestamps`` (ms
        since the epoch; default: now) and, if given, all to ``partition``; waits until the
        broker acknowledged every one (an error if any failed). The number written."""
        from confluent_kafka import Producer

        errors: list = []
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 20, "log_level": 3,
                             "enable.idempotence": True, "compression.type": "lz4"})

        def _ack(err, _msg):
            if err is not None:
                errors.append(err)

        n = 0
        for i, (key, value) in enumerate(records):
            kw = {} if partition is None else {"partition": partition}
            if timestamps is not None:
                kw["timestamp"] = int(timestamps[i])
            send(producer, topic, value, key=key, on_delivery=_ack, **kw)
            n += 1
        left = producer.flush(120)
        if errors or left:
            raise RuntimeError(f"writing to Kafka topic {topic!r} failed: {left} records "
                               f"unacknowledged, errors {errors[:3]}")
        return n

    def end_offsets(self, topic: str) -> List[int]:
        """The end offset of each partition of ``topic`` (records written so far)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "stretch-probe",
                             "enable.auto.commit": False})
        try:
            parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
            return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                    for p in sorted(parts)]
        finally:
            consumer.close()

    def records(self, topic: str, timeout: float = 60) -> List[Tuple[int, bytes]]:
        """Every record now in ``topic``: (its time in ms since the epoch, its value), partition
        by partition, each in offset order."""
        from confluent_kafka import Consumer, TopicPartition

        ends = self.end_offsets(topic)
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "stretch-read",
                             "enable.auto.commit": False, "log_level": 3})
        out: List[Tuple[int, bytes]] = []
        try:
            for p, end in enumerate(ends):
                consumer.assign([TopicPartition(topic, p, 0)])
                offset, deadline = 0, time.monotonic() + timeout
                while offset < end:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"reading {topic!r} partition {p}: {offset} of "
                                           f"{end} records in {timeout} s")
                    for m in consumer.consume(10_000, timeout=1.0):
                        if m.error():
                            raise RuntimeError(f"reading {topic!r}: {m.error()}")
                        out.append((m.timestamp()[1], m.value()))
                        offset = m.offset() + 1
        finally:
            consumer.close()
        return out

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """End the broker's JVM (SIGTERM, then SIGKILL after 20 s) and remove its directory."""
        if self._proc is not None:
            end_process_groups([self._proc], term_wait=20.0)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
