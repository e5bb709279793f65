"""The package's version: a driver and the host engines it starts must run the same one (the
engine refuses another at start, ``host/daemon.py``'s ``preflight``). Kept equal to
``pyproject.toml``'s ``version`` (``tests/protocol/test_version.py``)."""

__version__ = "0.1.0"
