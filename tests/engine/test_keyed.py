"""The drop-ins' keyed state store (``engine/keyed.py``) against a plain dict of the same steps.

Oracle: a dict ``(bucket, key) -> (value, timeout)`` updated by the same operations; the due
timers are the dict's keys whose timeout is set and earlier than the threshold.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_stretch.engine.keyed import NO_TIMEOUT, KeyedStore, encode_key, unpack_snapshot

BUCKETS = 3
op = st.tuples(st.sampled_from(["put", "delete"]), st.integers(0, BUCKETS - 1),
               st.integers(0, 12), st.integers(-1, 50))
steps = st.lists(st.lists(op, max_size=12), min_size=1, max_size=6)


def _model_due(model, bucket, threshold):
    """(timeout, key) of the due keys, in timeout order, then the store's key order."""
    return sorted(((t, k) for (b, k), (_, t) in model.items()
                   if b == bucket and t != NO_TIMEOUT and t < threshold),
                  key=lambda x: (x[0], encode_key(bucket, (x[1],))))


@settings(max_examples=60, deadline=None)
@given(steps=steps, threshold=st.integers(0, 60))
def test_steps_and_their_changelogs_rebuild_the_same_state_as_a_dict(tmp_path_factory, steps,
                                                                     threshold):
    d = tmp_path_factory.mktemp("kv")
    kv = KeyedStore(d / "live")
    model, logs = {}, []
    for seq, ops in enumerate(steps):
        s = kv.step()
        for what, b, k, t in ops:
            kb = encode_key(b, (f"k{k}",))
            if what == "put":
                s.put(kb, ((f"k{k}",), (k * 10,), t))
                model[(b, f"k{k}")] = ((k * 10,), t)
            else:
                s.delete(kb)
                model.pop((b, f"k{k}"), None)
        # read-your-writes, before the commit: values and due timers
        for (b, k), (v, t) in model.items():
            assert s.get(encode_key(b, (k,))) == ((k,), v, t)
        for b in range(BUCKETS):
            want = [encode_key(b, (k,)) for _, k in _model_due(model, b, threshold)]
            assert sorted(s.due(b, threshold)) == sorted(want)
        logs.append(s.commit(0, seq, "done"))
        assert kv.applied(0, seq) == "done" and kv.applied(0, seq + 1) is None
    got = {(int.from_bytes(kb[:2], "big"), e[0][0]): (e[1], e[2]) for kb, e in kv.entries()}
    assert got == model and kv.rows() == len(model)
    for b in range(BUCKETS):  # committed timers, in timeout order
        s = kv.step()
        assert s.due(b, threshold) == [encode_key(b, (k,))
                                       for _, k in _model_due(model, b, threshold)]
        s.abort()
    # a restore: the first step's copy, then the other steps' changelogs
    first = KeyedStore(d / "first")
    first.apply(logs[0])
    snap = first.snapshot(d / "snap.mdb.zst")
    first.close()
    (d / "restored").mkdir()
    unpack_snapshot(snap, d / "restored" / "data.mdb")
    restored = KeyedStore(d / "restored")
    for log in logs[1:]:
        restored.apply(log)
    assert dict(restored.entries()) == dict(kv.entries())
    s = restored.step()
    for b in range(BUCKETS):
        assert s.due(b, threshold) == [encode_key(b, (k,))
                                       for _, k in _model_due(model, b, threshold)]
    s.abort()
    restored.close()
    kv.close()


def test_numpy_and_python_scalars_are_one_key():
    import numpy as np

    assert encode_key(1, (np.int64(5), np.str_("a"))) == encode_key(1, (5, "a"))
    assert encode_key(1, (5,)) != encode_key(2, (5,))


def test_a_snapshot_is_the_state_of_its_read_transaction(tmp_path):
    kv = KeyedStore(tmp_path / "kv")
    s = kv.step()
    s.put(encode_key(0, ("a",)), (("a",), (1,), NO_TIMEOUT))
    s.commit(0, 1, None)
    txn = kv.env.begin()  # the batch's version
    s = kv.step()
    s.put(encode_key(0, ("b",)), (("b",), (2,), NO_TIMEOUT))
    s.commit(0, 2, None)  # the next step, while the copy has not begun
    kv.snapshot(tmp_path / "snap.mdb.zst", txn)
    (tmp_path / "r").mkdir()
    unpack_snapshot(tmp_path / "snap.mdb.zst", tmp_path / "r" / "data.mdb")
    r = KeyedStore(tmp_path / "r")
    assert [e[0] for _, e in r.entries()] == [("a",)]
    r.close()
    kv.close()


def test_changelog_of_moves_the_selected_buckets_only(tmp_path):
    src, dst = KeyedStore(tmp_path / "a"), KeyedStore(tmp_path / "b")
    want = {}
    step = src.step()
    for b in range(6):
        for k in range(3):
            kb = encode_key(b, (f"u{b}-{k}",))
            entry = ((f"u{b}-{k}",), (b, k), 1000 * b + k if k else NO_TIMEOUT)
            step.put(kb, entry)
            if b % 2:
                want[kb] = entry
    step.commit(0, 1, None, step.changelog())
    dst.apply(src.changelog_of(np.arange(6) % 2 == 1))
    assert dict(dst.entries()) == want
    # the timers came along: bucket 3's two keys with a timeout are due, bucket 2's are not
    s = dst.step()
    assert sorted(s.due(3, 10 ** 6)) == sorted(k for k, e in want.items()
                                                if k[:2] == (3).to_bytes(2, "big") and e[2] > 0)
    assert s.due(2, 10 ** 6) == []
    s.abort()
    src.close(), dst.close()


timers_op = st.tuples(st.sampled_from(["put", "delete"]), st.integers(0, BUCKETS - 1),
                      st.integers(0, 8), st.frozensets(st.integers(0, 40), max_size=4))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(timers_op, max_size=10), min_size=1, max_size=5),
       st.integers(0, 45))
def test_several_timers_per_key_against_a_dict(tmp_path_factory, steps, threshold):
    # transformWithState keeps a tuple of timers per key: every one is in the timer index,
    # due in timer order (then key order), committed or pending alike; a changelog applied
    # to another store gives the same index.
    kv = KeyedStore(tmp_path_factory.mktemp("timers"))
    other = KeyedStore(tmp_path_factory.mktemp("copy"))
    model = {}
    for seq, step_ops in enumerate(steps):
        s = kv.step()
        for what, b, k, times in step_ops:
            kb = encode_key(b, (k,))
            if what == "put":
                s.put(kb, ((k,), {"v": k}, tuple(sorted(times))))
                model[(b, k)] = set(times)
            else:
                s.delete(kb)
                model.pop((b, k), None)
        for b in range(BUCKETS):  # (pending writes seen before the commit)
            want = sorted((t, encode_key(b, (k,))) for (bb, k), ts in model.items() if bb == b
                          for t in ts if t < threshold)
            assert s.due_timers(b, threshold) == want
        other.apply(s.commit(0, seq, "r"))
    for store in (kv, other):
        s = store.step()
        for b in range(BUCKETS):
            want = sorted((t, encode_key(b, (k,))) for (bb, k), ts in model.items() if bb == b
                          for t in ts if t < threshold)
            assert s.due_timers(b, threshold) == want
            assert s.due(b, threshold) == [kb for _, kb in want]
        s.abort()
        with store.env.begin() as t:  # (no stale timer left in the index)
            assert t.stat(store.timers)["entries"] == sum(len(ts) for ts in model.values())
    kv.close()
    other.close()


def test_a_store_past_its_memory_share_drops_the_pages_it_mapped(tmp_path):
    """``memory``: after each write the store's pages this process has mapped (its own
    ``/proc/self/smaps``) are within it, though the store is many times larger; every entry
    reads back. Without it, reading the store maps all of it (what the bound is against)."""
    entries = {}
    kv = KeyedStore(tmp_path / "kv", memory=256 << 10)
    for seq in range(6):
        s = kv.step()
        for i in range(seq * 2000, (seq + 1) * 2000):
            kb = encode_key(i % 3, (f"user-{i}",))
            entries[kb] = ((f"user-{i}",), ("x" * 200, i), 1000 + i)
            s.put(kb, entries[kb])
        s.commit(0, seq, None)
        assert kv.held() <= kv.memory
    assert kv.disk_bytes() > 8 * kv.memory
    s = kv.step()
    assert all(s.get(kb) == e for kb, e in entries.items())
    assert kv.held() > 2 * kv.memory  # (reading maps the pages: dropped at the next write)
    s.delete(next(iter(entries)))
    s.commit(0, 6, None)
    assert kv.held() <= kv.memory
    kv.close()
    unbounded = KeyedStore(tmp_path / "kv")
    s = unbounded.step()
    assert all(s.get(kb) == e for kb, e in list(entries.items())[1:])
    s.commit(0, 7, None)
    assert unbounded.held() > 2 * (256 << 10)
    unbounded.close()


def test_a_snapshot_that_cannot_be_written_raises_and_leaves_no_file(tmp_path):
    # The copy goes through a pipe to a compressing thread: the thread's failure (here: no
    # directory to write into) stops LMDB's copy instead of leaving it blocked on the pipe.
    kv = KeyedStore(tmp_path / "kv")
    s = kv.step()
    for i in range(20_000):  # (more than a pipe's buffer)
        s.put(encode_key(0, (i,)), ((i,), (i,), NO_TIMEOUT))
    s.commit(0, 1, None)
    with pytest.raises(FileNotFoundError):
        kv.snapshot(tmp_path / "missing" / "snap.mdb.zst")
    assert not (tmp_path / "missing").exists()
    kv.snapshot(tmp_path / "snap.mdb.zst")  # (the store is unharmed)
    (tmp_path / "r").mkdir()
    unpack_snapshot(tmp_path / "snap.mdb.zst", tmp_path / "r" / "data.mdb")
    r = KeyedStore(tmp_path / "r")
    assert r.rows() == 20_000
    r.close()
    kv.close()
