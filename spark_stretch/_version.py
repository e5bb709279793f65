"""The package version, in a module of its own: the host engine and the driver read it from here,
not from the package's ``__init__`` (which imports the driver's API and PySpark), so the layers
of ``pyproject.toml``'s import contracts hold."""

__version__ = "0.1.0"
