"""What pyspark's ``ApplyInPandasWithStateSerializer`` does with the DataFrames a function returns."""

from __future__ import annotations

from typing import List

import numpy as np
import pyarrow as pa

__all__ = ["OutputBuffer", "concat_padded", "to_arrow"]


class OutputBuffer:
    """What ``ApplyInPandasWithStateSerializer.dump_stream`` does with the returned DataFrames:
    non-empty ones are concatenated (padded with null rows up to the number of states, as there)
    and converted to Arrow with pyspark's conversion, in batches of ~maxRecordsPerBatch rows."""

    def __init__(self, inst):
        self.inst = inst
        self.pdfs = []
        self.rows = 0
        self.states = 0
        self.batches: List[pa.RecordBatch] = []

    def add(self, pdf) -> None:
        if len(pdf) > 0:
            self.rows += len(pdf)
            self.pdfs.append(pdf)
            if self.rows > self.inst.max_records:
                self._convert()

    def state_done(self) -> None:
        self.states += 1

    def _convert(self) -> None:
        inst = self.inst
        if self.rows:
            total = max(1, max(self.rows, self.states))
            merged = concat_padded(self.pdfs, inst.out_schema.names, total - self.rows)
            self.batches.append(to_arrow(inst, merged).slice(0, self.rows))
        self.pdfs, self.rows, self.states = [], 0, 0

    def finish(self) -> List[pa.RecordBatch]:
        self._convert()
        return self.batches


def to_arrow(inst, pdf) -> pa.RecordBatch:
    """``pdf`` in Arrow of instance ``inst``'s output schema, by pyspark's own conversion
    (columns by name or position, Arrow casts), with the query's Arrow settings."""
    from pyspark.sql.conversion import PandasToArrowConversion

    return PandasToArrowConversion.convert(
        pdf, inst.out_schema, timezone=inst.tz, safecheck=inst.safecheck, arrow_cast=True,
        assign_cols_by_name=inst.assign_cols_by_name,
        int_to_decimal_coercion_enabled=inst.int_to_decimal)


def concat_padded(pdfs: list, names: List[str], pad: int):
    """``pd.concat(pdfs + [an all-None frame of the columns names, pad rows],
    ignore_index=True)``, as pyspark's serializer builds it.

    The pad frame is appended also with 0 rows: it changes the dtypes concat gives (every
    column becomes ``object``), as in native Spark. pandas concatenates frame by frame (~80 us
    a frame): for many small frames of the same columns and column types (a function yielding
    a row or a few per key), the same frame is built from the frames' column arrays at once
    (pandas' blocks: a pandas whose internals differ gets ``pd.concat``, and the tests say so);
    anything else goes to ``pd.concat`` itself.

    Examples
    --------
    >>> import pandas as pd
    >>> m = concat_padded([pd.DataFrame({"k": ["a"], "n": [1]})] * 2, ["k", "n"], 1)
    >>> m.equals(pd.concat([pd.DataFrame({"k": ["a"], "n": [1]})] * 2
    ...                    + [pd.DataFrame({"k": [None], "n": [None]})], ignore_index=True))
    True
    """
    import pandas as pd

    padding = pd.DataFrame(dict.fromkeys(names), index=list(range(pad)))
    try:
        fast = _concat_same_layout(pdfs, names, pad, padding)
    except (AttributeError, TypeError):  # (pandas' internals moved: its own concat still holds)
        fast = None
    return fast if fast is not None else pd.concat(list(pdfs) + [padding], ignore_index=True)


def _concat_same_layout(pdfs: list, names: List[str], pad: int, padding):
    """The padded concatenation of ``pdfs`` when every frame has exactly the columns ``names``
    with the same types (numpy bool, integer, float or object, or pandas strings) and concat
    makes every column ``object`` (the pad's doing); else None."""
    import pandas as pd

    first = pdfs[0]
    if list(first.columns) != list(names) or len(set(names)) != len(names):
        return None
    # (what concat makes of the first frame's column types with the pad's: object throughout)
    if not all(d == object for d in pd.concat([first.iloc[:0], padding.iloc[:0]],
                                              ignore_index=True).dtypes):
        return None
    layout = [(b.dtype, tuple(b.mgr_locs.as_array)) for b in first._mgr.blocks]
    if not all(_plain(dt) for dt, _ in layout):
        return None
    parts: List[list] = [[] for _ in layout]
    for p in pdfs:
        blocks = p._mgr.blocks
        if len(blocks) != len(layout) or (p.columns is not first.columns
                                          and list(p.columns) != list(names)):
            return None
        for j, b in enumerate(blocks):
            if b.dtype != layout[j][0] or tuple(b.mgr_locs.as_array) != layout[j][1]:
                return None
            parts[j].append(b.values)
    columns: dict = {}
    for (_, locs), values in zip(layout, parts):
        if isinstance(values[0], np.ndarray):  # (a 2-d block: a row per column)
            merged = np.concatenate(values, axis=1).astype(object)
            for r, loc in enumerate(locs):
                columns[loc] = merged[r]
        else:  # (an extension array: one column)
            columns[locs[0]] = np.asarray(
                type(values[0])._concat_same_type(values).astype(object), dtype=object)
    out = {}
    for i, name in enumerate(names):
        col = columns[i]
        out[name] = np.concatenate([col, np.full(pad, None, dtype=object)]) if pad else col
    return pd.DataFrame(out, dtype=object, copy=False)


def _plain(dtype) -> bool:
    """Column types whose values ``astype(object)`` gives as ``pd.concat`` does."""
    import pandas as pd

    if isinstance(dtype, np.dtype):
        return dtype.kind in "biufO"
    return isinstance(dtype, pd.StringDtype)
