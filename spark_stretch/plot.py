"""A Fig. 11-style plot of an elastic query (stretch-tpds §8.5): input rate, parallelism and
event-time latency over time, from its per-batch figures, as a PNG (matplotlib). Each point is a
batch, at the time its output was written.

From a query, ``plot_metrics(q.metrics(), "run.png")``; from the command line, with the figures
saved as JSON (``json.dump(q.metrics(), f)``), a Delta metrics table
(``spark.stretch.metrics.table``, a path) or a CSV of ``q.metrics_frame()``::

    python -m spark_stretch.plot METRICS [-o run.png] [--title TITLE]

Examples
--------
>>> import tempfile, os
>>> from spark_stretch.driver.policy import BatchMetrics
>>> rows = [BatchMetrics(batch=b, parallelism=1 + (3 <= b < 6), max_parallelism=2,
...                      time_ms=500 * b, input_rate=[1e3, 5e4][3 <= b < 6],
...                      latency_p99_ms=200.0, utilization=[0.5]).row() for b in range(9)]
>>> d = tempfile.TemporaryDirectory()
>>> out = os.path.join(d.name, "run.png")
>>> fig = plot_metrics({"per_batch": rows}, out, title="stepped rate")
>>> [ax.get_ylabel() for ax in fig.axes]
['input rate (rows/s)', 'parallelism', 'event-time latency (ms)']
>>> os.path.getsize(out) > 0
True
>>> d.cleanup()
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Union

__all__ = ["plot_metrics", "load_metrics", "main"]

_CAUSE_COLORS = {"scale_out": "tab:red", "scale_in": "tab:green", "rebalance": "tab:purple",
                 "manual": "tab:gray"}


def load_metrics(source: Union[str, Path, dict]):
    """The per-batch figures of ``source`` as a pandas DataFrame: ``q.metrics()`` (a dict), its
    JSON file, a Delta metrics table (a directory with ``_delta_log``; its first query's rows
    unless one ``stretch_id`` is in it) or a CSV of ``q.metrics_frame()``."""
    import pandas as pd

    from .driver.elastic import per_batch_frame

    if isinstance(source, dict):
        return per_batch_frame(source)
    if hasattr(source, "columns"):  # a DataFrame already
        return source
    path = Path(source)
    if path.is_dir() and (path / "_delta_log").is_dir():
        from deltalake import DeltaTable

        df = DeltaTable(str(path)).to_pandas()
        first = df["stretch_id"].iloc[0] if len(df) else None
        df = df[df["stretch_id"] == first].sort_values("batch")
        df["time_ms"] = pd.to_datetime(df["time"]).astype("int64") // 1_000_000
        return per_batch_frame({"per_batch": df.to_dict("records")})
    if path.suffix == ".csv":
        return per_batch_frame({"per_batch": pd.read_csv(path).to_dict("records")})
    return per_batch_frame(json.loads(path.read_text()))


def plot_metrics(metrics, path: Optional[Union[str, Path]] = None, title: Optional[str] = None):
    """Plot a query's input rate, parallelism (each epoch switch marked by its cause) and
    event-time latency (p50, p99 of each batch's output rows) against seconds since its
    first batch; save a PNG at ``path`` if given. ``metrics``: what :func:`load_metrics`
    takes. Returns the matplotlib Figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    df = load_metrics(metrics)
    fig, (rate, par, lat) = plt.subplots(3, 1, sharex=True, figsize=(9, 7))
    x = df["seconds"] if len(df) else []
    if len(df):
        rate.plot(x, df["input_rate"], color="tab:blue")
        par.step(x, df["parallelism"], where="post", color="black")
        top = int(max(df.get("max_parallelism", df["parallelism"]).max(), 1))
        par.set_ylim(0, top + 0.5)
        par.set_yticks(range(0, top + 1))
        for _, r in df[df["switched"].notna()].iterrows() if "switched" in df else []:
            par.axvline(r["seconds"], color=_CAUSE_COLORS.get(r["switched"], "tab:gray"),
                        linestyle=":", linewidth=1)
        for q, style in (("latency_p50_ms", "-"), ("latency_p99_ms", "--")):
            if q in df:
                lat.plot(x, df[q], style, label=q[8:11], color="tab:red")
    rate.set_ylabel("input rate (rows/s)")
    par.set_ylabel("parallelism")
    lat.set_ylabel("event-time latency (ms)")
    lat.legend(loc="upper right", fontsize="small")
    lat.set_xlabel("seconds since the first batch")
    handles = [plt.Line2D([], [], color=c, linestyle=":", label=k)
               for k, c in _CAUSE_COLORS.items()]
    par.legend(handles=handles, loc="upper right", fontsize="x-small", ncol=4)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def main(argv=None) -> Path:
    """``python -m spark_stretch.plot METRICS [-o PNG] [--title TITLE]``: the PNG's path."""
    ap = argparse.ArgumentParser(prog="python -m spark_stretch.plot", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("metrics", help="q.metrics() saved as JSON, a Delta metrics table path, or "
                                    "a CSV of q.metrics_frame()")
    ap.add_argument("-o", "--output", help="the PNG to write (default: METRICS with .png)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    out = Path(args.output or Path(args.metrics).with_suffix(".png"))
    plot_metrics(args.metrics, out, title=args.title)
    print(out)
    return out


if __name__ == "__main__":
    main()
