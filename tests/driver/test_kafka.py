"""Kafka -> ``stretch(df)`` -> Delta, on a real broker (:class:`KafkaBroker`): exactly once with
the engine or the driver killed (-9) mid-run, the table equal to native Spark's on the same
topic. The query runs in a driver process of its own (``kafka_job.py``), with Spark's Kafka
connector beside Delta in its session."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_stretch.host.faults import ENV
from spark_stretch.testing import assert_same_rows, run_script
from spark_stretch.testing.kafka import KafkaBroker
from spark_stretch.testing.processes import driver_env, kill_driver_once_logged

pytestmark = pytest.mark.slow  # (a broker and a driver process per run: CI's -m slow)
JOB = Path(__file__).with_name("kafka_job.py")
TOPIC = "words"
EVENTS, PER_BATCH = 6000, 1000  # 6 batches of 500 records from each of 2 partitions
T0 = 1_767_225_600_000  # 2026-01-01, ms


def _produce(kafka: KafkaBroker) -> None:
    """Words in event-time order (100 ms apart) dealt to the 2 partitions in turn, so every
    batch advances both partitions alike and no record is late: the table does not depend on
    where batches end (the native oracle reads the same topic in the same batches anyway)."""
    rng = random.Random(7)
    words = [f"w{rng.randrange(60)}".encode() for _ in range(EVENTS)]
    for p in (0, 1):
        kafka.produce(TOPIC, [(None, w) for w in words[p::2]],
                      timestamps=[T0 + 100 * i for i in range(p, EVENTS, 2)], partition=p)


@pytest.fixture(scope="module")
def topic(tmp_path_factory):
    """The broker with the topic written, and the native table over it (the oracle)."""
    tmp = tmp_path_factory.mktemp("kafka")
    with KafkaBroker() as kafka:
        kafka.create_topic(TOPIC, partitions=2)
        _produce(kafka)
        assert kafka.end_offsets(TOPIC) == [EVENTS // 2] * 2
        run = run_script(JOB, kafka.bootstrap, TOPIC, tmp / "native", tmp / "native-ckpt",
                         "native", PER_BATCH)
        assert run["batches"] >= EVENTS // PER_BATCH
        yield kafka, tmp / "native"


def _job(kafka, tmp_path, spelling="stretch"):
    return [str(a) for a in (JOB, kafka.bootstrap, TOPIC, tmp_path / "o", tmp_path / "c",
                             spelling, PER_BATCH)]


def _equal(spark, got: Path, want: Path):
    got, want = (spark.read.format("delta").load(str(p)) for p in (got, want))
    assert_same_rows(got, want)
    assert want.count() > 100


def test_kafka_through_stretch_with_the_engine_killed_equals_native(spark, topic, tmp_path,
                                                                    monkeypatch):
    # kill -9 of the engine as it steps batch 2: it restarts from its checkpoint, Spark's
    # offsets log replays the batches after it from Kafka, Delta's txn keeps the table exact.
    kafka, native = topic
    monkeypatch.setenv(ENV, f"kill@step:2:{tmp_path / 'fired'}")
    run = run_script(*_job(kafka, tmp_path))
    assert (tmp_path / "fired").exists(), "the fault did not fire"
    assert len(run["restarts"]) == 1, run
    _equal(spark, tmp_path / "o", native)


def test_kafka_through_stretch_with_the_driver_killed_then_restarted_equals_native(
        spark, topic, tmp_path):
    kafka, native = topic
    env = driver_env(tmp_path, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen([sys.executable, *_job(kafka, tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    # batch 2 logged; Spark may or may not have committed it
    kill_driver_once_logged(proc, tmp_path / "c" / "stretch" / "input" / "2.arrow")
    committed = [int(f.name) for f in (tmp_path / "c" / "commits").iterdir()
                 if f.name.isdigit()]
    assert max(committed, default=-1) < EVENTS // PER_BATCH - 1, "the run ended before the kill"
    run = run_script(*_job(kafka, tmp_path))
    assert run["restarts"] == [], run
    _equal(spark, tmp_path / "o", native)


def test_records_read_back_with_the_brokers_append_times(topic):
    # The fixture's topic read back whole (the records as written, partition by partition), and
    # a topic made with LogAppendTime: its records carry the broker's time, not the producer's
    # (how python/bench/latency.py times a query's output)
    kafka, _ = topic
    got = kafka.records(TOPIC)
    assert len(got) == EVENTS and [ts for ts, _ in got[:2]] == [T0, T0 + 200]
    assert all(v.startswith(b"w") for _, v in got)
    kafka.create_topic("appended", 1, {"message.timestamp.type": "LogAppendTime"})
    before = int(time.time() * 1000)
    kafka.produce("appended", [(None, b"a"), (None, b"b")], timestamps=[T0, T0])
    after = int(time.time() * 1000)
    got = kafka.records("appended")
    assert [v for _, v in got] == [b"a", b"b"]
    assert all(before <= ts <= after for ts, _ in got), (before, got, after)
