from importlib.metadata import version

import spark_stretch
from spark_stretch.protocol.version import __version__


def test_one_version_for_the_package_its_metadata_and_its_processes():
    assert spark_stretch.__version__ == __version__ == version("spark-stretch")
