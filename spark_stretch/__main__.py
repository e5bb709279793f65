"""``python -m spark_stretch warm``: compile the engine's kernels on this machine
(:mod:`spark_stretch.api.warm`; ``make setup`` runs it), then build them ahead of time into the
library the engine loads without numba (:mod:`spark_stretch.engine.aot`)."""

from __future__ import annotations

import sys
import time


def main(argv) -> int:
    if argv != ["warm"]:
        print("usage: python -m spark_stretch warm", file=sys.stderr)
        return 2
    import spark_stretch
    from spark_stretch.api.warm import warm

    spark = spark_stretch.session(app_name="spark-stretch warm-up")
    try:
        print(f"spark-stretch: the engine's kernels compiled and cached in {warm(spark):.0f} s")
    finally:
        spark.stop()  # (its engines keep the signatures they compiled as they close)
    from spark_stretch.engine.aot import build

    t0 = time.perf_counter()
    try:
        path = build()
    except Exception as e:  # (no C compiler: the engines compile with numba, as before)
        print(f"spark-stretch: the engine's kernels were not built ahead of time: {e}",
              file=sys.stderr)
        return 0
    print(f"spark-stretch: the engine's kernels built ahead of time in "
          f"{time.perf_counter() - t0:.0f} s ({path.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
