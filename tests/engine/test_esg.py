"""ESG: timestamp-ordered release, deterministic ties, watermarks, late drops, elastic sources/readers."""
import numpy as np
import pyarrow as pa
import pytest

from spark_stretch.engine import ESG, Control, EngineError, Interner, ListColumn


def ts_of(items):
    return [t for it in items if not isinstance(it, Control) for t in it.ts.tolist()]


def test_ordered_sources_release_in_ts_order_when_every_source_passed():
    esg = ESG()
    esg.add_sources([0, 1])
    esg.add_readers([7])
    esg.add({"ts": np.array([1, 4, 9])}, 0)
    assert ts_of(esg.get(7)) == []  # source 1 said nothing yet
    esg.add({"ts": np.array([2, 4])}, 1)
    # frontier = min(9, 4) = 4: ready are ts < 4
    assert ts_of(esg.get(7)) == [1, 2]
    esg.add({"ts": np.array([10])}, 1)
    assert ts_of(esg.get(7)) == [4, 4]  # tie at 4: source 0 first, then source 1
    assert esg.watermark == 8


def test_ties_are_broken_by_source_then_insertion_order_whatever_the_add_order():
    def run(order):
        esg = ESG()
        esg.add_sources([0, 1, 2], ordered=False)
        esg.add_readers([0])
        for s in order:
            esg.add({"ts": np.array([5, 5]), "v": np.array([10 * s, 10 * s + 1])}, s)
        esg.advance_watermark(5)
        seg = esg.get(0)[0]
        return seg.parts[0]["v"].tolist(), seg.seq.tolist()

    assert run([0, 1, 2]) == run([2, 0, 1]) == ([0, 1, 10, 11, 20, 21], [0, 1, 2, 3, 4, 5])


def test_late_tuples_are_dropped_and_counted():
    esg = ESG()
    esg.add_sources([0], ordered=False)
    esg.add_readers([0])
    esg.advance_watermark(10)
    esg.add({"ts": np.array([3, 10, 11, 12])}, 0)
    assert esg.late_dropped == 2
    esg.advance_watermark(12)
    assert ts_of(esg.get(0)) == [11, 12]


def test_out_of_order_from_an_ordered_source_is_an_error_and_the_esg_stays_usable():
    esg = ESG()
    esg.add_sources([0])
    esg.add_readers([0])
    esg.add({"ts": np.array([5, 6])}, 0)
    with pytest.raises(EngineError, match="out-of-order timestamp 4 from ordered source 0"):
        esg.add({"ts": np.array([4])}, 0)
    with pytest.raises(EngineError, match="out-of-order timestamp 2"):
        esg.add({"ts": np.array([7, 2])}, 0)
    esg.add({"ts": np.array([7])}, 0)
    esg.add_watermark(7, 0)
    assert ts_of(esg.get(0)) == [5, 6, 7]


def test_tuple_from_a_removed_source_is_an_error():
    esg = ESG()
    esg.add_sources([0, 1], ordered=False)
    esg.add_readers([0])
    esg.add({"ts": np.array([3])}, 1)
    assert esg.remove_sources([1])
    with pytest.raises(EngineError, match="source 1 was removed"):
        esg.add({"ts": np.array([4])}, 1)
    with pytest.raises(EngineError, match="source 5 is not a source"):
        esg.add({"ts": np.array([4])}, 5)
    esg.add_watermark(5, 0)  # the removed source's pending tuple is released with the others
    assert ts_of(esg.get(0)) == [3]


def test_readers_added_later_start_where_the_inviting_reader_is():
    esg = ESG()
    esg.add_sources([0], ordered=False)
    esg.add_readers([0])
    esg.add({"ts": np.array([1])}, 0)
    esg.advance_watermark(1)
    assert ts_of(esg.get(0)) == [1]
    esg.add({"ts": np.array([2])}, 0)
    esg.advance_watermark(2)
    assert esg.add_readers([1], j=0)
    assert not esg.add_readers([1], j=0)  # already a reader
    assert ts_of(esg.get(1)) == ts_of(esg.get(0)) == [2]
    assert esg.remove_readers([1])
    with pytest.raises(EngineError, match="reader 1 is not a reader"):
        esg.get(1)


def test_new_sources_start_at_the_current_watermark():
    esg = ESG()
    esg.add_sources([0], ordered=False)
    esg.advance_watermark(20)
    esg.add_sources([1], ordered=False)
    esg.add({"ts": np.array([15, 25])}, 1)
    assert esg.late_dropped == 1


def test_arrow_batches_strings_and_lists_are_interned_exactly():
    it = Interner()
    esg = ESG(interner=it)
    esg.add_sources([0], ordered=False)
    esg.add_readers([0])
    rb = pa.RecordBatch.from_pydict({"ts": pa.array([2, 1], pa.int64()), "user": ["bob", "al"],
                                     "words": [["x", "y", "x"], []]})
    esg.add(rb, 0)
    esg.advance_watermark(2)
    part = esg.get(0)[0].parts[0]
    assert it.lookup(part["user"]) == ["al", "bob"]
    assert isinstance(part["words"], ListColumn)
    assert [it.lookup(w) for w in part["words"].to_pylist()] == [[], ["x", "y", "x"]]


def test_bad_batches_get_clear_errors():
    esg = ESG()
    esg.add_sources([0], ordered=False)
    with pytest.raises(EngineError, match="no timestamp column 'ts'"):
        esg.add({"t": np.array([1])}, 0)
    with pytest.raises(EngineError, match="int64 timestamps"):
        esg.add({"ts": np.array([1.5])}, 0)
    with pytest.raises(EngineError, match="column 'v' has 2 rows"):
        esg.add({"ts": np.array([1]), "v": np.array([1, 2])}, 0)
    esg.add({"ts": np.array([1]), "v": np.array([1])}, 0)
    with pytest.raises(EngineError, match="differ from stream 0's schema"):
        esg.add({"ts": np.array([2]), "w": np.array([1])}, 0)
    with pytest.raises(EngineError, match="holds strings but this ESG has no interner"):
        ESG().add({"ts": np.array([1]), "s": np.array(["a"])}, 0)


def test_multi_stream_segments_keep_each_streams_schema():
    esg = ESG(n_streams=2)
    esg.add_sources([0], stream=0, ordered=False)
    esg.add_sources([1], stream=1, ordered=False)
    esg.add_readers([0])
    esg.add({"ts": np.array([1, 3]), "a": np.array([10, 30])}, 0)
    esg.add({"ts": np.array([2]), "b": np.array([0.5])}, 1)
    esg.advance_watermark(5)
    seg = esg.get(0)[0]
    assert seg.ts.tolist() == [1, 2, 3] and seg.stream.tolist() == [0, 1, 0]
    assert [seg.parts[s][c][r] for s, r, c in zip(seg.stream, seg.row, ["a", "b", "a"])] == [10, 0.5, 30]
