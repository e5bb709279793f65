"""Builds the Scala shim jar from ``jvm_shim/`` with the Scala compiler that the pyspark wheel ships.

No sbt needed: ``java -cp "<pyspark>/jars/*" scala.tools.nsc.Main -usejavacp -d OUT FILES``, then
the classes and ``META-INF/services`` are zipped. The jar is cached under
``$SPARK_STRETCH_CACHE`` (default ``~/.cache/spark-stretch``) by a hash of the sources, the pyspark
version and the Java version, so it is rebuilt only when one of them changes.

Examples
--------
>>> from spark_stretch.driver.shim import shim_jar
>>> shim_jar().name.startswith("spark-stretch-shim-")  # doctest: +SKIP
True
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

__all__ = ["shim_jar", "shim_package", "shim_sources", "ShimBuildError", "SHIM_GROUP", "SHIM_ARTIFACT"]

# The shim's Maven coordinates in the local Ivy repository (shim_package); the version is the
# package's plus the jar's source hash, so a changed shim is a new version to Ivy's caches.
SHIM_GROUP = "io.github.spark-stretch"
SHIM_ARTIFACT = "spark-stretch-shim_2.13"


class ShimBuildError(RuntimeError):
    """The Scala shim could not be compiled (the compiler's output is in the message)."""


def shim_sources() -> Path:
    """The ``jvm_shim`` directory: packaged in the wheel, or beside the package in a checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_jvm_shim", here.parent / "jvm_shim"):
        if (candidate / "src" / "main" / "scala").is_dir():
            return candidate
    raise ShimBuildError(f"jvm_shim sources not found next to {here}")


def _pyspark_jars() -> Path:
    import pyspark

    jars = Path(pyspark.__file__).resolve().parent / "jars"
    if not any(jars.glob("scala-compiler-*.jar")):
        raise ShimBuildError(f"no scala-compiler jar in {jars}; the pyspark wheel should ship one")
    return jars


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    java = Path(home, "bin", "java") if home else shutil.which("java")
    if not java or not Path(java).exists():
        raise ShimBuildError("java not found: install a JDK 17+ or set JAVA_HOME")
    return str(java)


def _digest(src: Path, jars: Path) -> str:
    import pyspark

    h = hashlib.sha256()
    for f in sorted(p for p in src.rglob("*") if p.is_file() and "target" not in p.parts):
        h.update(str(f.relative_to(src)).encode())
        h.update(f.read_bytes())
    h.update(pyspark.__version__.encode())
    java_version = subprocess.run([_java(), "-version"], capture_output=True, text=True).stderr
    h.update(java_version.split("\n", 1)[0].encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("SPARK_STRETCH_CACHE", Path.home() / ".cache" / "spark-stretch"))


def shim_jar(rebuild: bool = False) -> Path:
    """Path to the shim jar, compiling it first if its sources changed since the cached build.

    Parameters
    ----------
    rebuild : bool
        Compile even if a jar for the current sources is cached.

    Notes
    -----
    Concurrent callers (several test processes) wait on a file lock; the jar appears atomically.
    """
    src = shim_sources()
    jars = _pyspark_jars()
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    jar = out_dir / f"spark-stretch-shim-{_digest(src, jars)}.jar"
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if jar.exists() and not rebuild:
            return jar
        _compile(src, jars, jar)
    return jar


def _compile(src: Path, jars: Path, jar: Path) -> None:
    scala_files = sorted(str(p) for p in (src / "src" / "main" / "scala").rglob("*.scala"))
    with tempfile.TemporaryDirectory(prefix="stretch-shim-") as tmp:
        classes = Path(tmp, "classes")
        classes.mkdir()
        cmd = [_java(), "-cp", f"{jars}/*", "scala.tools.nsc.Main", "-usejavacp",
               "-deprecation", "-d", str(classes), *scala_files]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ShimBuildError("scalac failed:\n" + proc.stdout + proc.stderr)
        partial = jar.with_suffix(".jar.partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: spark-stretch\n\n")
            for root in (classes, src / "src" / "main" / "resources"):
                for f in sorted(root.rglob("*")):
                    if f.is_file():
                        z.write(f, str(f.relative_to(root)))
        os.replace(partial, jar)


def default_ivy_dir() -> Path:
    """Where Spark's Ivy keeps its cache and local repository without ``spark.jars.ivy``:
    ``~/.ivy2.5.2`` (Spark 4's ``MavenUtils.processIvyPathArg``; a driver started with the JVM
    property ``ivy.home`` should set ``spark.jars.ivy`` as well)."""
    return Path.home() / ".ivy2.5.2"


def shim_package(ivy: "str | Path | None" = None) -> str:
    """Publish the shim jar to the local Ivy repository that Spark resolves packages from
    (``<ivy>/local``, as ``sbt publishLocal`` would) and return its Maven coordinates, for
    ``spark.jars.packages``: Spark then resolves it on the driver and serves it to executors
    with every other package.

    Parameters
    ----------
    ivy : str or Path, optional
        The session's ``spark.jars.ivy``; default :func:`default_ivy_dir`.

    Examples
    --------
    >>> from spark_stretch.driver.shim import shim_package
    >>> shim_package().startswith("io.github.spark-stretch:spark-stretch-shim_2.13:")  # doctest: +SKIP
    True
    """
    from ..protocol.version import __version__

    jar = shim_jar()
    version = f"{__version__}-{jar.stem.rsplit('-', 1)[-1]}"
    root = Path(ivy) if ivy else default_ivy_dir()
    rev = root / "local" / SHIM_GROUP / SHIM_ARTIFACT / version
    if not (rev / "jars" / f"{SHIM_ARTIFACT}.jar").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".publish-", dir=_mkdir(rev.parent)))
        try:
            (tmp / "jars").mkdir()
            (tmp / "ivys").mkdir()
            shutil.copyfile(jar, tmp / "jars" / f"{SHIM_ARTIFACT}.jar")
            (tmp / "ivys" / "ivy.xml").write_text(_IVY_XML.format(
                group=SHIM_GROUP, artifact=SHIM_ARTIFACT, version=version))
            try:
                os.rename(tmp, rev)
            except OSError:
                if not rev.is_dir():  # (else another process published it first)
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return f"{SHIM_GROUP}:{SHIM_ARTIFACT}:{version}"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


_IVY_XML = """<?xml version="1.0" encoding="UTF-8"?>
<ivy-module version="2.0">
  <info organisation="{group}" module="{artifact}" revision="{version}" status="release"/>
  <configurations>
    <conf name="default" visibility="public"/>
    <conf name="runtime" visibility="public"/>
  </configurations>
  <publications>
    <artifact name="{artifact}" type="jar" ext="jar" conf="default,runtime"/>
  </publications>
  <dependencies/>
</ivy-module>
"""


if __name__ == "__main__":  # python -m spark_stretch.driver.shim  -> builds and prints the jar path
    print(shim_jar())
