"""Fixtures of the Spark tests: one local[2] session for the run, a receiver per test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tests' own harness module


@pytest.fixture(scope="session")
def spark():
    import spark_stretch

    session = spark_stretch.session(app_name="spark-stretch tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def receiver():
    import spark_stretch

    with spark_stretch.Receiver() as r:
        yield r
