"""Code of the host engine process (``python -m spark_stretch.host.daemon``): no PySpark here.

One engine process serves the executors of its host and its driver: :mod:`.daemon` routes the
data source's frames (:mod:`.receiver`) and the driver's control messages to one runtime per open
query (:mod:`.runtime`, :mod:`.aggregate`, :mod:`.operator`, :mod:`.grouped` with its instance
processes in :mod:`.instances`), which keep their state in the VSN engine
(:mod:`spark_stretch.engine`) or in shared-memory buckets, checkpoint it (:mod:`.checkpoints`,
:mod:`.input_log`), read Parquet (:mod:`.parquet`) and append to Delta (:mod:`.delta`) themselves.
Tests inject faults at named points (:mod:`.faults`).
"""
