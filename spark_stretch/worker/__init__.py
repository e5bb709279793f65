"""Code of the ``applyInPandasWithState`` drop-in's instance processes.

An instance runs the user's function for the keys of the buckets it owns (:mod:`.instance`),
started by the host engine as ``python -m spark_stretch.worker`` (:mod:`.__main__`, with
``SPARK_STRETCH_PROCESS=worker``: the package root attaches no driver API). Nothing here imports
the driver or the host engine; what crosses to the engine is
:mod:`spark_stretch.protocol.instances`.
"""
