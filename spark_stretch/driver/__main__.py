"""``python -m spark_stretch.driver``: make this machine ready (``make setup`` runs it).

Builds the shim jar (:func:`~spark_stretch.driver.shim.shim_jar`) and has Spark's Ivy resolve
Delta's jars once (:func:`~spark_stretch.driver.session.delta_jars`), printing their paths.
``--resolve IVY PACKAGES`` is the child process that resolution runs in.
"""

from __future__ import annotations

import json
import sys

from .session import delta_jars, resolve
from .shim import cache_dir, shim_jar


def main(argv) -> int:
    if len(argv) in (3, 4) and argv[0] == "--resolve":  # the child process of package_jars
        ivy_conf = json.loads(argv[3]) if len(argv) == 4 else {}
        print("JARS " + ",".join(resolve(argv[1], argv[2], ivy_conf)))
        return 0
    if argv:
        print("usage: python -m spark_stretch.driver [--resolve IVY PACKAGES [IVY_CONF_JSON]]", file=sys.stderr)
        return 2
    print(shim_jar())
    print("\n".join(delta_jars(cache_dir() / "ivy")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
