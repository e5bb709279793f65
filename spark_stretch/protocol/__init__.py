"""What the processes of spark-stretch agree on, and nothing else: no PySpark, no numba.

The driver (:mod:`spark_stretch.driver`), the host engine (:mod:`spark_stretch.host`), the
drop-in's instance processes (:mod:`spark_stretch.worker`) and the JVM shim (``jvm_shim/``) talk
through what is defined here:

- :mod:`.framing`: a frame on a stretch socket (a length, a JSON header, maybe Arrow IPC);
- :mod:`.messages`: one typed message per operation, with its typed reply, versioned;
- :mod:`.instances`: the messages between the host engine and the drop-in's instances;
- :mod:`.errors`: error codes carried by a failed reply, and the exceptions they map to;
- :mod:`.specs`: the versioned spec of a query, as the driver sends it to its host engine;
- :mod:`.version`: the package's version, the same in every process;
- :mod:`.placement`: key -> bucket -> instance, the one placement policy of every runtime;
- :mod:`.layout`: where a query keeps its checkpoint, input log and shared memory, and the
  format versions of those files;
- :mod:`.lifecycle`: how one process starts another so that the child dies with it.
"""
