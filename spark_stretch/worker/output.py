"""What pyspark's ``ApplyInPandasWithStateSerializer`` does with the DataFrames a function returns."""

from __future__ import annotations

from typing import List

import pyarrow as pa

__all__ = ["OutputBuffer"]


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
        import pandas as pd
        from pyspark.sql.conversion import PandasToArrowConversion

        inst = self.inst
        if self.rows:
            schema = inst.out_schema
            total = max(1, max(self.rows, self.states))
            # always appended, also with 0 rows: it changes the dtypes concat gives (e.g. a
            # pandas 3 "str" column becomes object), as in native Spark
            pdfs = list(self.pdfs) + [pd.DataFrame(dict.fromkeys(schema.names),
                                                   index=list(range(total - self.rows)))]
            merged = pd.concat(pdfs, ignore_index=True)
            rb = PandasToArrowConversion.convert(
                merged, schema, timezone=inst.tz, safecheck=inst.safecheck, arrow_cast=True,
                assign_cols_by_name=inst.assign_cols_by_name,
                int_to_decimal_coercion_enabled=inst.int_to_decimal)
            self.batches.append(rb.slice(0, self.rows))
        self.pdfs, self.rows, self.states = [], 0, 0

    def finish(self) -> List[pa.RecordBatch]:
        self._convert()
        return self.batches
