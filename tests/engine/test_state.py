"""State: interning, owner maps, bucket tables (exact keys, growth), nogil kernels vs naive references."""
import numpy as np
import pytest

from spark_stretch.engine import BucketState, EngineError, Interner, balanced_owner_map
from spark_stretch.engine import kernels as K
from spark_stretch.engine.state import validate_owner_map


def test_interner_ids_are_exact_and_stable():
    it = Interner()
    a = it.intern(["x", "y", "x", "z"])
    b = it.intern(["z", "w"])
    assert a.tolist() == [0, 1, 0, 2] and b.tolist() == [2, 3]
    assert it.lookup([3, 0]) == ["w", "x"]
    assert Interner(it.strings()).intern(["w"]).tolist() == [3]
    with pytest.raises(EngineError, match="null"):
        it.intern(__import__("pyarrow").array(["a", None]))


def test_owner_map_validation_names_the_missing_bucket():
    om = balanced_owner_map(8, [0, 1])
    assert validate_owner_map(om, 8, [0, 1]).tolist() == [0] * 4 + [1] * 4
    with pytest.raises(EngineError, match="owner_map misses bucket 3: its owner 5"):
        validate_owner_map([0, 1, 0, 5, 0, 1, 0, 1], 8, [0, 1])
    with pytest.raises(EngineError, match=r"each of the B=8 buckets \(length 8\)"):
        validate_owner_map([0, 1], 8, [0, 1])
    with pytest.raises(EngineError, match="integer array"):
        validate_owner_map(np.zeros(8), 8, [0])


def _naive_bucket(key, nb):
    # plain-Python splitmix64 (oracle for the jitted mix64)
    m = (1 << 64) - 1
    z = (key + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (((z ^ (z >> 31)) >> 32) * nb) >> 32


def test_bucket_of_matches_naive_python():
    keys = np.array([0, 1, 2, -1, 2 ** 40 + 3, -(2 ** 62), (7 << 32) | 9], np.int64)
    got = K.buckets_of(keys, 1024)
    want = [_naive_bucket(int(k) & ((1 << 64) - 1), 1024) for k in keys]
    assert got.tolist() == want


def test_full_key_compare_no_collision_mistakes_and_growth():
    st = BucketState(1, 1, 1, [0], [0.0], cap=4)  # one bucket: every key collides on the bucket
    keys = np.arange(-50, 50, dtype=np.int64) * 7919
    for rep in range(3):
        for k in keys:
            for l in (0, 10):
                while True:
                    s = K.find_or_insert(0, np.uint64(K.mix64(k)), k, l, st.rec, st.acc_f, st.bcount, st.bminl,
                                         st.init_i, st.init_f)
                    if s >= 0:
                        break
                    st.grow()
                st.rec[0, s, 2] += 1
    k, l, ai, _ = st.bucket_rows()
    assert len(k) == 200 and st.live_windows() == 200
    assert set(zip(k.tolist(), l.tolist())) == {(int(x), y) for x in keys for y in (0, 10)}
    assert (ai[:, 0] == 3).all()
    assert st.bminl[0] == 0


def test_take_list_matches_python():
    off = np.array([0, 2, 2, 5], np.int64)
    vals = np.array([1, 2, 3, 4, 5], np.int64)
    o, v = K.take_list(off, vals, np.array([2, 0, 2, 1], np.int64))
    rows = [v[o[i]:o[i + 1]].tolist() for i in range(4)]
    assert rows == [[3, 4, 5], [1, 2], [3, 4, 5], []]
