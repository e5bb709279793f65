"""``python -m spark_stretch warm``: compile the engine's kernels on this machine
(:mod:`spark_stretch.api.warm`; ``make setup`` runs it)."""

from __future__ import annotations

import sys


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
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
