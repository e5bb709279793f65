"""Which embedded store holds the drop-in's state: LMDB, RocksDB (rocksdict) or pickled buckets.

    python python/bench/state_store.py [--sizes 1000000,4000000] [--touch 50000] [--value 100]
                                       [--json]

The drop-in's batch reads and writes the state of the keys it touches (one get and one put of a
``--value``-byte pickled value per key) and keeps the state over 256 buckets. For each live-state
size (``--sizes``: keys already in the store), in a fresh directory under ``$TMPDIR``, each
candidate runs three batches of ``--touch`` random keys (a third of them new), one process, and
reports the best batch's time, with the bytes a checkpoint of that batch writes:

- ``pickled``: the format of spark-stretch <= 0.18 (one pickled dict per bucket, every bucket a
  batch touches rewritten whole; with 50k keys over 256 buckets, all of them): the batch's cost
  and its checkpoint grow with the state;
- ``lmdb``: one LMDB environment (``sync=False``, ``writemap``), the batch's writes in one write
  transaction, its changes appended to a changelog (the checkpoint);
- ``rocksdict``: one RocksDB (WAL off, as Spark's RocksDB state store), a write batch, its
  checkpoint the new SST files after a flush (hard links of a RocksDB checkpoint).

Also the disk bytes per key. The choice is the store whose batch time stays flat and lowest.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import struct
import tempfile
import time

import numpy as np

B = 256


def _key(k: int) -> bytes:
    return struct.pack(">H", k % B) + pickle.dumps((int(k),), protocol=5)


_POOL = np.random.default_rng(1).bytes(1 << 22)


def _value(rng, size: int) -> bytes:
    """A distinct pickled value of about ``size`` bytes (a slice of a random pool: cheap)."""
    at = int(rng.integers(0, len(_POOL) - size))
    return pickle.dumps((_POOL[at:at + size], -1), protocol=5)


def _disk(d: str, suffix: str = "") -> int:
    """Bytes on disk (allocated blocks: LMDB's file is sparse up to its map size)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in os.listdir(d)
               if f.endswith(suffix))


def _touched(rng, n: int, touch: int) -> np.ndarray:
    old = rng.integers(0, n, size=touch - touch // 3)
    new = np.arange(n, n + touch // 3)
    return np.concatenate([old, new])


def bench_lmdb(d: str, n: int, touch: int, vsize: int, rng) -> dict:
    import lmdb

    env = lmdb.open(d, map_size=1 << 40, sync=False, writemap=True, max_dbs=4, lock=True)
    db = env.open_db(b"state")
    for lo in range(0, n, 200_000):
        with env.begin(write=True, db=db) as t:
            for k in range(lo, min(n, lo + 200_000)):
                t.put(_key(k), _value(rng, vsize), db=db)
    best, ck = None, 0
    for r in range(3):
        keys = _touched(rng, n + r * touch, touch)
        vals = [_value(rng, vsize) for _ in keys]
        t0 = time.perf_counter()
        changes = {}
        with env.begin(db=db) as t:
            for k in keys:
                kb = _key(k)
                old = t.get(kb, db=db)
                if old is not None:
                    pickle.loads(old)
                changes[kb] = vals[len(changes)]
        log = pickle.dumps(changes, protocol=5)  # the batch's changelog: its checkpoint
        with env.begin(write=True, db=db) as t:
            for kb, v in changes.items():
                t.put(kb, v, db=db)
        dt = time.perf_counter() - t0
        if best is None or dt < best:
            best, ck = dt, len(log)
    disk = _disk(d, ".mdb")
    env.close()
    return {"batch_ms": best * 1e3, "checkpoint_bytes": ck, "disk_bytes_per_key": disk / n}


def bench_rocksdict(d: str, n: int, touch: int, vsize: int, rng) -> dict:
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    opts = Options(raw_mode=True)
    db = Rdict(d, opts)
    wo = WriteOptions()
    wo.disable_wal = True
    db.set_write_options(wo)
    for lo in range(0, n, 200_000):
        wb = WriteBatch(raw_mode=True)
        for k in range(lo, min(n, lo + 200_000)):
            wb.put(_key(k), _value(rng, vsize))
        db.write(wb)
    db.flush()
    best, ck = None, 0
    for r in range(3):
        keys = _touched(rng, n + r * touch, touch)
        vals = [_value(rng, vsize) for _ in keys]
        before = {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                  if f.endswith(".sst")}
        t0 = time.perf_counter()
        wb = WriteBatch(raw_mode=True)
        for k, v in zip(keys, vals):
            kb = _key(k)
            old = db.get(kb)
            if old is not None:
                pickle.loads(old)
            wb.put(kb, v)
        db.write(wb)
        db.flush()  # a checkpoint needs the batch in SST files
        dt = time.perf_counter() - t0
        new = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                  if f.endswith(".sst") and f not in before)
        if best is None or dt < best:
            best, ck = dt, new
    disk = _disk(d, ".sst")
    db.close()
    return {"batch_ms": best * 1e3, "checkpoint_bytes": ck, "disk_bytes_per_key": disk / n}


def bench_pickled(d: str, n: int, touch: int, vsize: int, rng) -> dict:
    buckets = [dict() for _ in range(B)]
    for k in range(n):
        buckets[k % B][(k,)] = pickle.loads(_value(rng, vsize))
    for b in range(B):
        with open(os.path.join(d, f"b{b}.pkl"), "wb") as f:
            f.write(pickle.dumps(buckets[b], protocol=5))
    buckets = None
    best, ck = None, 0
    for r in range(3):
        keys = _touched(rng, n + r * touch, touch)
        vals = [_value(rng, vsize) for _ in keys]
        t0 = time.perf_counter()
        cache, size = {}, 0
        for k, v in zip(keys, vals):  # the owner reads its buckets once, then rewrites every changed one
            b = int(k) % B
            if b not in cache:
                with open(os.path.join(d, f"b{b}.pkl"), "rb") as f:
                    cache[b] = pickle.loads(f.read())
            cache[b].get((int(k),))
            cache[b][(int(k),)] = pickle.loads(v)
        for b, bd in cache.items():
            blob = pickle.dumps(bd, protocol=5)
            size += len(blob)
            with open(os.path.join(d, f"b{b}.pkl"), "wb") as f:
                f.write(blob)
        dt = time.perf_counter() - t0
        if best is None or dt < best:
            best, ck = dt, size
    disk = _disk(d)
    return {"batch_ms": best * 1e3, "checkpoint_bytes": ck, "disk_bytes_per_key": disk / n}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000000,4000000")
    p.add_argument("--touch", type=int, default=50_000)
    p.add_argument("--value", type=int, default=100)
    p.add_argument("--stores", default="pickled,lmdb,rocksdict")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    runs = {"pickled": bench_pickled, "lmdb": bench_lmdb, "rocksdict": bench_rocksdict}
    res = {}
    for n in [int(x) for x in a.sizes.split(",")]:
        for name in a.stores.split(","):
            d = tempfile.mkdtemp(prefix=f"stretch-bench-{name}-")
            try:
                r = runs[name](d, n, a.touch, a.value, np.random.default_rng(7))
            finally:
                shutil.rmtree(d, ignore_errors=True)
            res[f"{name}@{n}"] = r
            print(f"{name:10s} {n:>10,d} keys: batch of {a.touch:,d} keys "
                  f"{r['batch_ms']:8.1f} ms, "
                  f"checkpoint {r['checkpoint_bytes'] / 1e6:8.2f} MB, "
                  f"disk {r['disk_bytes_per_key']:6.1f} B/key", flush=True)
    if a.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
