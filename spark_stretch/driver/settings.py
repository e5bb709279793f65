"""Every ``spark.stretch.*`` session setting, declared once: its default, its check, its doc.

A query reads them when it starts (:func:`read_settings`); a bad value is a ``ValueError``
naming the key and the value, before anything runs. The README's Settings table lists exactly
these (a test holds the two equal).

Examples
--------
>>> from spark_stretch.driver.settings import SETTINGS
>>> SETTINGS["spark.stretch.checkpoint.interval"].default
'10'
>>> SETTINGS["spark.stretch.checkpoint.interval"].parse("0")
Traceback (most recent call last):
...
ValueError: spark.stretch.checkpoint.interval='0': must be an integer >= 1 (batches between two engine checkpoints)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..protocol.specs import parse_bytes

__all__ = ["Setting", "SETTINGS", "QuerySettings", "read_settings"]


@dataclass(frozen=True)
class Setting:
    """One session setting.

    ``kind`` is ``bool``, ``int`` (within ``least``..``most``), ``choice`` (one of ``choices``,
    each with what it means) or ``text`` (matching ``pattern``, as ``choices[0]`` says, if it is
    set); ``doc`` is the README's sentence for it.
    """

    key: str
    default: str
    kind: str
    doc: str
    least: Optional[int] = None
    most: Optional[int] = None
    choices: Tuple[Tuple[str, str], ...] = ()
    pattern: Optional[str] = None

    def parse(self, raw: Optional[str]):
        """The typed value of ``raw`` (None: the default), or a ValueError naming the key."""
        value = self.default if raw is None else str(raw)
        if self.kind == "bool":
            if value.lower() not in ("true", "false"):
                (t, if_true), (f, if_false) = self.choices
                raise ValueError(f"{self.key}='{value}': must be 'true' ({if_true}) or 'false' "
                                 f"({if_false})")
            return value.lower() == "true"
        if self.kind == "int":
            try:
                n = int(value)
                ok = n >= self.least and (self.most is None or n <= self.most)
            except ValueError:
                ok = False
            if not ok:
                bounds = f">= {self.least}" if self.most is None else \
                    f"from {self.least} to {self.most}"
                raise ValueError(f"{self.key}='{value}': must be an integer {bounds} "
                                 f"({self.choices[0][1]})")
            return n
        if self.kind == "choice":
            if value.lower() not in dict(self.choices):
                said = " or ".join(f"'{c}' ({what})" for c, what in self.choices)
                raise ValueError(f"{self.key}='{value}': must be {said}")
            return value.lower()
        if value and self.pattern and not re.fullmatch(self.pattern, value):
            raise ValueError(f"{self.key}='{value}': must be {self.choices[0][1]}")
        return value


def _int(key, default, least, most, what, doc):
    return Setting(key, str(default), "int", doc, least, most, (("", what),))


def _bool(key, default, if_true, if_false, doc):
    return Setting(key, default, "bool", doc, choices=(("true", if_true), ("false", if_false)))


SETTINGS: Dict[str, Setting] = {s.key: s for s in (
    Setting("spark.stretch.onEngineFailure", "restart", "choice",
            "`restart` the engine from its last checkpoint and retry the batch, or `fail` the "
            "query",
            choices=(("restart", "restart the engine from the last checkpoint and retry the "
                                 "batch"), ("fail", "fail the query"))),
    _int("spark.stretch.maxEngineRestarts", 3, 0, None,
         "engine restarts in a row before the query fails",
         "engine restarts in a row before the query fails"),
    _int("spark.stretch.instanceMaxFailures", 4, 1, None,
         "runs of an instance's share of a step whose process dies",
         "the drop-in: how many times an instance's share of a micro-batch is run when its "
         "process dies (a new process runs only that share again; 1: the first death fails "
         "the batch), as `spark.task.maxFailures` bounds a task's attempts"),
    _int("spark.stretch.checkpoint.interval", 10, 1, None,
         "batches between two engine checkpoints",
         "batches between two engine checkpoints (the input log is the delta between)"),
    _bool("spark.stretch.checkpoint.fsync", "false",
          "fsync each engine checkpoint (survives a power cut)",
          "write and rename it, as Spark writes its own checkpoint",
          "fsync each engine checkpoint (Spark does not fsync its own)"),
    _bool("spark.stretch.delta.directWrite", "true",
          "the engine appends to a path-based Delta sink itself", "Spark writes every batch",
          "the engine appends each batch to a path-based Delta sink itself; `false`: Spark "
          "writes it"),
    _bool("spark.stretch.ingest.files", "true",
          "the engine reads a batch's Parquet files itself when Spark would only read them",
          "Spark reads them",
          "the engine reads a Parquet or Delta source's batch files itself when Spark would "
          "read them as plain Parquet (no column mapping or deletion vectors; needs "
          "`ingest.columnar`; not the drop-in)"),
    _bool("spark.stretch.ingest.columnar", "true",
          "a batch read by a columnar scan goes to the engine as its columns",
          "always as the rows foreachBatch hands over",
          "a columnar scan (Parquet, Delta) goes to the engine as its columns; `false`: as rows"),
    _int("spark.stretch.engine.niceness", 5, 0, 19,
         "0: the engine's threads compete with Spark's as equals; 19: they run only when Spark "
         "leaves a core idle",
         "the host engine's nice value (0-19): its work is off Spark's critical path"),
    _bool("spark.stretch.fallback", "true",
          "an aggregation the engine cannot run runs natively, with a FallbackWarning",
          "stretch() raises an error naming the reason",
          "`stretch(df)`: an aggregation the engine cannot run yet runs natively with a "
          "`FallbackWarning` naming the reason; `false`: an error naming it"),
    _int("spark.stretch.keyGroups", 128, 1, 1 << 16,
         "key groups a query's keys are split into across hosts",
         "a query on several hosts: the key groups its keys are split into across hosts, "
         "fixed per query (kept in its checkpoint); at least the number of hosts"),
    _int("spark.stretch.engine.leaseSeconds", 30, 2, None,
         "seconds a host engine waits for its driver before it exits",
         "a query on several hosts: an executor host's engine exits when its driver has not "
         "reached it for this long (a killed driver leaves nothing behind)"),
    Setting("spark.stretch.metrics.table", "", "text",
            "a Delta table (a path, or a table name) every stretch query appends its per-batch "
            "figures to (`q.metrics()[\"per_batch\"]`: rates, latency, utilization, "
            "parallelism, switches), in the background",
            choices=(("", "a Delta table path or a table name"),), pattern=r"\S+"),
    Setting("spark.stretch.state.memory", "", "text",
            "the memory an engine keeps its state in on each host (`512m`, `4g`); past it, "
            "the aggregation state's tables live in files on the host's local disk, paged in as "
            "batches touch them (slower, not out of memory), and the drop-ins' processes drop the "
            "store pages they mapped past their share; unset: half the host's memory",
            choices=(("", "a size such as '512m' or '4g'"),),
            pattern=r"\d+(\.\d+)?[kKmMgGtT]?[bB]?"),
    Setting("spark.stretch.testClockMs", "", "text",
            "tests only: `<start>[+<step>]` makes the drop-in's batch N run at processing time "
            "`start + N * step` ms",
            choices=(("", "'<start>[+<step>]' in milliseconds, e.g. '0+1000' (tests only)"),),
            pattern=r"\d+(\+\d+)?"),
)}


@dataclass(frozen=True)
class QuerySettings:
    """The settings a query runs with, read once when it starts."""

    on_failure: str
    max_restarts: int
    instance_max_failures: int
    checkpoint_interval: int
    fsync: bool
    direct_write: bool
    read_files: bool
    columnar: bool
    niceness: int
    fallback: bool
    test_clock: str
    metrics_table: str
    key_groups: int
    lease_s: int
    state_memory: int  # bytes (0: the engine's default, half its host's memory)
    # Spark's own state store settings, followed by the engine's checkpoints
    min_deltas: int
    min_batches_to_retain: int


def read_settings(conf) -> QuerySettings:
    """The query settings of a session's ``conf`` (``spark.conf``); ValueError naming the first
    bad key."""
    v = {k: s.parse(conf.get(k, None)) for k, s in SETTINGS.items()}
    return QuerySettings(
        on_failure=v["spark.stretch.onEngineFailure"],
        max_restarts=v["spark.stretch.maxEngineRestarts"],
        instance_max_failures=v["spark.stretch.instanceMaxFailures"],
        checkpoint_interval=v["spark.stretch.checkpoint.interval"],
        fsync=v["spark.stretch.checkpoint.fsync"],
        direct_write=v["spark.stretch.delta.directWrite"],
        read_files=v["spark.stretch.ingest.files"],
        columnar=v["spark.stretch.ingest.columnar"],
        niceness=v["spark.stretch.engine.niceness"],
        fallback=v["spark.stretch.fallback"],
        test_clock=v["spark.stretch.testClockMs"],
        metrics_table=v["spark.stretch.metrics.table"],
        key_groups=v["spark.stretch.keyGroups"],
        lease_s=v["spark.stretch.engine.leaseSeconds"],
        state_memory=parse_bytes(v["spark.stretch.state.memory"] or 0),
        min_deltas=int(conf.get("spark.sql.streaming.stateStore.minDeltasForSnapshot", "10")),
        min_batches_to_retain=int(conf.get("spark.sql.streaming.minBatchesToRetain", "100")))
