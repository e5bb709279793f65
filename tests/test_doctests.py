"""Every docstring example that needs no Spark session runs, and shows what it says.

Examples that need a running query or session are marked ``# doctest: +SKIP`` where they stand;
the rest (the protocol, the host engine's pieces, the engine, settings, test data) run here.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import spark_stretch

MODULES = sorted(m.name for m in pkgutil.walk_packages(spark_stretch.__path__, "spark_stretch.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
