"""``StretchQuery``: the handle on a running stretch query, as ``StreamingQuery`` is on Spark's.

It has every method of pyspark's :class:`~pyspark.sql.streaming.StreamingQuery`, each forwarded
to Spark's query explicitly (as pyspark's own ``streaming/query.py`` forwards to the JVM), plus
what only stretch has: :meth:`StretchQuery.reconfigure`, :meth:`StretchQuery.metrics` and
:meth:`StretchQuery.metrics_frame`.
"""

from __future__ import annotations

from typing import List, Optional

from pyspark.errors import StreamingQueryException

from ..driver.elastic import per_batch_frame
from ..driver.run import QueryRun

__all__ = ["StretchQuery"]


class StretchQuery:
    """A running stretch query: a :class:`~pyspark.sql.streaming.StreamingQuery` plus
    :meth:`reconfigure`, :meth:`metrics` and :meth:`metrics_frame`.

    Examples
    --------
    >>> q = counts.writeStream.format("delta").option("checkpointLocation", ckpt).start(out)  # doctest: +SKIP
    >>> q.reconfigure(parallelism=2)["parallelism"]       # doctest: +SKIP
    2
    >>> q.awaitTermination(); q.metrics()["batches"]      # doctest: +SKIP
    10
    """

    def __init__(self, run: QueryRun):
        self._run = run

    # -- stretch -------------------------------------------------------------------------------
    @property
    def stretch_id(self) -> str:
        """The query's id on its host engine (kept in its checkpoint)."""
        return self._run.stretch_id

    def reconfigure(self, parallelism: Optional[int] = None, owner_map=None,
                    key_groups=None, host: Optional[str] = None) -> dict:
        """Change the number of instances and/or the bucket-to-instance owner map, online; or,
        for a query on several hosts, which host owns which key groups.

        Instances and owner map: no restart, no shuffle, no state copied: the engine of each
        host switches epoch between two micro-batches. Key groups: between two micro-batches,
        the state of the groups that change hosts moves to their new hosts through the
        query's checkpoint (every host writes its state in full, then each opens the query
        again with the state of the groups it owns next). Returns what happened, including
        the switch time in ms (also in :meth:`metrics`).

        Parameters
        ----------
        parallelism : int, optional
            New number of active instances (on each host), 1 to ``max_parallelism``.
        owner_map : sequence of int, optional
            Owner instance for each of the ``buckets`` buckets (a rebalance).
        host : str, optional
            On several hosts, the host whose instances take ``parallelism``/``owner_map``
            (as ``metrics()["engine"]["hosts"]`` names it); every host's when not given.
        key_groups : dict or sequence of int, optional
            How many of the query's key groups (``spark.stretch.keyGroups``) each host owns
            next: ``{host: count}`` with hosts as Spark names the executors' hosts
            (``metrics()["engine"]["hosts"]``), or a list in that order; the counts add up
            to the query's key groups. As few groups move as can.

        Examples
        --------
        >>> q.reconfigure(parallelism=2)            # doctest: +SKIP
        {'epoch': 1, 'parallelism': 2, 'switch_ms': 0.21, 'after_batch': 3, ...}
        >>> q.reconfigure(key_groups={"10.0.0.2": 128, "10.0.0.3": 0})  # doctest: +SKIP
        {'key_groups': {'10.0.0.2': 128, '10.0.0.3': 0}, 'moved_groups': 64, ...}
        """
        return self._run.reconfigure(parallelism, owner_map, key_groups, host)

    def metrics(self) -> dict:
        """Engine and per-batch figures: parallelism, epoch, switch times, late rows, timings
        (see :mod:`spark_stretch.driver.metrics` for the keys); ``per_batch`` has each batch's
        rates, event-time latency, utilization and load per instance, parallelism and epoch
        switch, and ``reconfigurations`` each switch with its ``cause``.

        Examples
        --------
        >>> m = q.metrics()                                          # doctest: +SKIP
        >>> m["per_batch"][-1]["utilization"], m["per_batch"][-1]["latency_p99_ms"]  # doctest: +SKIP
        ([0.41, 0.39], 2150.0)
        """
        return self._run.figures()

    def metrics_frame(self):
        """``metrics()["per_batch"]`` as a pandas DataFrame, one row per batch (``time``,
        ``seconds`` since the first, ``input_rate``, ``parallelism``, ``latency_p99_ms``,
        ``utilization_max``, ``imbalance``, ``switched``, ``switch_ms``, ...).

        Examples
        --------
        >>> q.metrics_frame()[["batch", "input_rate", "parallelism"]].tail(2)   # doctest: +SKIP
           batch  input_rate  parallelism
        8      8      4980.1            2
        9      9      1012.7            1
        """
        return per_batch_frame(self._run.figures())

    # -- StreamingQuery ------------------------------------------------------------------------
    @property
    def id(self) -> str:
        """The query's unique id, kept across restarts from its checkpoint."""
        return self._run.query.id

    @property
    def runId(self) -> str:
        """The id of this run of the query."""
        return self._run.query.runId

    @property
    def name(self) -> Optional[str]:
        """The name given with ``queryName``, or None."""
        return self._run.query.name

    @property
    def isActive(self) -> bool:
        """Whether the query is running."""
        return self._run.query.isActive

    @property
    def status(self) -> dict:
        """Spark's current status of the query."""
        return self._run.query.status

    @property
    def recentProgress(self) -> List[dict]:
        """Spark's progress updates of the query's last micro-batches."""
        return self._run.query.recentProgress

    @property
    def lastProgress(self) -> Optional[dict]:
        """Spark's last progress update, or None."""
        return self._run.query.lastProgress

    def awaitTermination(self, timeout: Optional[int] = None) -> Optional[bool]:
        """As ``StreamingQuery.awaitTermination``; when the run ends, also waits for its last
        flush (and raises what writing it raised)."""
        return self._run.await_termination(timeout)

    def processAllAvailable(self) -> None:
        """As ``StreamingQuery.processAllAvailable``; also waits until the last batch's output
        is written (micro-batches are pipelined)."""
        self._run.process_all_available()

    def stop(self) -> None:
        """Stop the query and release the host engine (stopped with the last query using it)."""
        self._run.stop()

    def explain(self, extended: bool = False) -> None:
        """Print Spark's plans of the query's last micro-batch."""
        self._run.query.explain(extended)

    def exception(self) -> Optional[StreamingQueryException]:
        """The exception that ended the query, or None."""
        return self._run.query.exception()

    def __repr__(self) -> str:
        q = self._run.query
        return f"StretchQuery(id={q.id if q else None}, format={self._run.sink.format})"
