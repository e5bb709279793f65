"""Quick start: a streaming job whose micro-batches travel through the host's stretch receiver
and land, exactly once, in a local Delta table.

Each micro-batch is written by the executors with ``format("stretch")`` (Arrow batches over a Unix
socket to this host's receiver), changed there with Arrow compute (no per-row Python), offered back
and read with ``spark.read.format("stretch")``, then appended to Delta with ``txnAppId`` /
``txnVersion`` so a replayed batch is a no-op. The job runs twice on a growing input folder: the
second run restarts from the checkpoint and picks up only the new files.

Run it::

    python examples/quickstart_delta.py [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import spark_stretch

SCHEMA = "ts TIMESTAMP, user STRING, amount DOUBLE"


def generate(src: Path, first_file: int, n_files: int, rows_per_file: int = 1000) -> None:
    """Write ``n_files`` parquet files of synthetic payments into ``src``."""
    src.mkdir(parents=True, exist_ok=True)
    for f in range(first_file, first_file + n_files):
        rng = np.random.default_rng(f)
        start = f * rows_per_file
        table = pa.table({
            "ts": pa.array((np.arange(start, start + rows_per_file) * 1_000_000).astype("int64"),
                           pa.timestamp("us", tz="UTC")),
            "user": pa.array([f"u{u}" for u in rng.integers(0, 50, rows_per_file)]),
            "amount": pa.array(np.round(rng.uniform(1, 100, rows_per_file), 2)),
        })
        pq.write_table(table, src / f"part-{f:05d}.parquet")


def run_stream(spark, src: Path, table: Path, checkpoint: Path) -> int:
    """Run the streaming job until the input folder is drained; returns the batches processed."""
    app_id = "quickstart-" + hashlib.sha1(str(table.resolve()).encode()).hexdigest()[:12]
    batches = []

    with spark_stretch.Receiver() as receiver:
        def process(batch_df, batch_id: int) -> None:
            batch_df.write.format("stretch").mode("append").options(**receiver.options("in")).save()
            data = receiver.take("in")
            if data is None or data.num_rows == 0:
                return
            cents = pc.cast(pc.round(pc.multiply(data["amount"], 100)), pa.int64())
            receiver.offer("out", data.append_column("amount_cents", cents))
            (spark.read.format("stretch").options(**receiver.options("out")).load()
             .write.format("delta").mode("append")
             .option("txnAppId", app_id).option("txnVersion", batch_id)
             .save(str(table)))
            receiver.offer("out", None)
            batches.append(batch_id)

        query = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src))
                 .writeStream.foreachBatch(process)
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
    return len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="working folder (default: a temporary one, removed after)")
    args = parser.parse_args()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="stretch-quickstart-"))
    src, table, ckpt = work / "input", work / "delta", work / "checkpoint"
    spark = spark_stretch.session(app_name="spark-stretch quickstart")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        generate(src, 0, 3)
        n1 = run_stream(spark, src, table, ckpt)
        generate(src, 3, 2)  # more data arrives; the query restarts from its checkpoint
        n2 = run_stream(spark, src, table, ckpt)
        df = spark.read.format("delta").load(str(table))
        print(f"\nbatches: {n1} in the first run, {n2} after the restart; Delta table {table}:")
        df.groupBy("user").agg({"amount_cents": "sum", "*": "count"}) \
          .orderBy("sum(amount_cents)", ascending=False).show(5)
        total, distinct = df.count(), df.select("ts").distinct().count()
        print(f"rows: {total}, distinct events: {distinct} (expected 5000 and 5000: no loss, "
              "no duplicates)")
        if total != 5000 or distinct != 5000:
            raise SystemExit("quick start FAILED: the Delta table is not exactly the input")
    finally:
        spark.stop()
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
