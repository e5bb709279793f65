"""The README's "On a cluster" recipe, end to end on a two-host cluster of this machine: the
executors run spark-stretch from a packed virtualenv shipped with the job (``spark.archives``),
not from the driver's environment.

1. builds this checkout's wheel and installs it, with its dependencies and ``venv-pack``, into a
   fresh virtualenv, runs ``python -m spark_stretch warm`` there (the engine's kernels compiled
   and, with a C compiler, built into a library, inside the environment), then packs it
   (``venv-pack``: the executors' machines need the same Python at the same path, which every
   host of this machine has; the library is used where their CPU is the same as here);
2. starts a standalone cluster with workers on 127.0.0.2 and 127.0.0.3, each with a home
   directory of its own (:class:`spark_stretch.testing.cluster.StandaloneCluster`);
3. runs a word count with ``stretchAggregate`` into Delta with ``PYSPARK_PYTHON=
   ./environment/bin/python`` and ``spark.archives=env.tar.gz#environment``: Spark unpacks the
   archive in each executor's directory, PySpark's workers and the stretch engine of each host
   run its Python;
4. reads the table back with Spark and checks it equals native Spark's, and says what ran each
   host engine's kernels (``"library"``: the packed library, numba not imported).

Run it (about 5-10 minutes; the virtualenv is about 700 MB, pyspark being most of it)::

    python examples/cluster_packed_venv.py [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pack(work: Path) -> Path:
    """This checkout as a wheel in a fresh virtualenv, packed: the job's ``env.tar.gz``."""
    archive = work / "env.tar.gz"
    if archive.exists():
        return archive
    wheels, env = work / "wheel", work / "env"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(ROOT)], check=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(env)], check=True)
    subprocess.run([str(env / "bin" / "pip"), "install", "-q", *map(str, wheels.glob("*.whl")),
                    "venv-pack"], check=True)
    # the kernels compiled and built into the environment, so every application's executors
    # start from them (an unpacked archive is a new directory each time: nothing else persists)
    # (cwd: not this checkout, whose spark_stretch folder `python -m` would import first)
    subprocess.run([str(env / "bin" / "python"), "-m", "spark_stretch", "warm"], check=True,
                   cwd=str(work), env={**os.environ, "PYSPARK_PYTHON": str(env / "bin" / "python"),
                        "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")})
    subprocess.run([str(env / "bin" / "venv-pack"), "-q", "-p", str(env), "-o", str(archive)],
                   check=True)
    return archive


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=None, help="a work directory (default: a new temporary "
                    "one); a packed env.tar.gz there is reused")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="stretch-packed-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"packing the executors' environment into {work} ...", flush=True)
    archive = pack(work)

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = "./environment/bin/python"  # the executors': the archive's
    from pyspark.sql import SparkSession

    import spark_stretch
    from spark_stretch.testing import run_native, sorted_rows, tweet_source, write_tweets
    from spark_stretch.testing.cluster import StandaloneCluster

    with StandaloneCluster(hosts=("127.0.0.2", "127.0.0.3")) as cluster:
        builder = (SparkSession.builder.master(cluster.url).appName("packed venv")
                   .config("spark.archives", f"{archive}#environment")
                   .config("spark.executor.memory", "1g")
                   .config("spark.sql.shuffle.partitions", "4"))
        spark = spark_stretch.configure_spark_with_stretch(builder).getOrCreate()
        try:
            src = write_tweets(work / "src", 6000, files=6, rate=20.0, seed=3)
            counts = tweet_source(spark, src).stretchAggregate(keys="words",
                                                               window="60 seconds")
            q = (counts.writeStream.format("delta")
                 .option("checkpointLocation", str(work / "ckpt")).trigger(availableNow=True)
                 .start(str(work / "out")))
            q.awaitTermination()
            engines = q.metrics()["engine"]["hosts"]
            hosts = sorted(h["host"] for h in engines)
            kernels = {h["host"]: h["kernels"] for h in engines}
            got = sorted_rows(spark.read.format("delta").load(str(work / "out")))
            want = sorted_rows(run_native(spark, counts, work / "native"))
        finally:
            spark.stop()
    print(f"engines on {hosts}; {len(got)} rows, equal to native Spark's: {got == want}; "
          f"kernels run by {kernels}")
    return 0 if got == want and len(hosts) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
