"""What grows with the number of hosts: the routing part of docs/scaling.md's model, computed
from the benchmark's own tweets (no Spark).

    python python/bench/scaling_model.py [--tweets 100000] [--groups 64] [--hosts 1,2,4,8,16,32]
                                         [--bytes-per-copy 60] [--json]

For each host count H (key groups spread evenly, ``balanced_host_map``), on the rows path each
tweet goes to every host that owns a key group of one of its keys (word count: its words; pair
count: the first words of its pairs, every word but the last), once per host: the copies per
tweet, and the copies that cross the network (a tweet is read on one host, chosen uniformly,
and its copy for that host stays there). Multiplied by the measured bytes of one copy on the
wire (two-host run of ``hosts.py``: ZSTD Arrow), the bytes between hosts per tweet; and the
share of keys each host steps (its step work is its share of the tuples' keys).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_stretch.engine.hashing import xxhash64
from spark_stretch.protocol.placement import balanced_host_map, key_group
from spark_stretch.testing import tweets_table


def model(tweets: int, groups: int, hosts: list, bytes_per_copy: float) -> dict:
    t = tweets_table(tweets, seed=1)
    words = t.column("words").combine_chunks()
    offsets = words.offsets.to_numpy()
    g = key_group(xxhash64(pc.list_flatten(words)), groups)
    row = np.repeat(np.arange(len(words)), np.diff(offsets))
    last = np.zeros(len(g), np.bool_)
    last[offsets[1:] - 1] = True  # (a pair count's tuple goes to the hosts of its first words)
    out = {"tweets": tweets, "groups": groups, "words_per_tweet": float(np.diff(offsets).mean()),
           "hosts": {}}
    for h in hosts:
        host_of = balanced_host_map(groups, h)[g]
        res = {}
        for name, sel in (("wordcount", np.ones(len(g), np.bool_)), ("paircount", ~last)):
            # distinct (tweet, host) pairs: the copies of each tweet
            pairs = np.unique(row[sel] * h + host_of[sel])
            copies = len(pairs) / tweets
            # a tweet read on host r keeps its own copy there: (h - 1) / h of copies cross
            cross = copies * (h - 1) / h
            load = np.bincount(host_of[sel], minlength=h) / sel.sum()
            res[name] = {"copies_per_tweet": copies, "crossing_per_tweet": cross,
                         "bytes_per_tweet": cross * bytes_per_copy,
                         "largest_key_share": float(load.max())}
        out["hosts"][h] = res
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tweets", type=int, default=100_000)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--hosts", default="1,2,4,8,16,32")
    p.add_argument("--bytes-per-copy", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = model(a.tweets, a.groups, [int(h) for h in a.hosts.split(",")], a.bytes_per_copy)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['tweets']} tweets, {res['words_per_tweet']:.1f} words each, "
          f"{res['groups']} key groups")
    print("hosts | query | copies/tweet | crossing/tweet | bytes/tweet | largest host's keys")
    for h, r in res["hosts"].items():
        for q, v in r.items():
            print(f"{h} | {q} | {v['copies_per_tweet']:.2f} | {v['crossing_per_tweet']:.2f} | "
                  f"{v['bytes_per_tweet']:.0f} | {v['largest_key_share']:.3f}")


if __name__ == "__main__":
    main()
