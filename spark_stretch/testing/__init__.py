"""Test helpers, shipped: synthetic streams (:mod:`.data`), native comparisons (:mod:`.native`) and
engine-script oracles (:mod:`.engine`, imported on its own: it loads the numba engine).

Examples
--------
>>> from spark_stretch.testing import tweets_table
>>> tweets_table(100, seed=1).num_rows
100
"""

from .data import points_table, publish, tweets_table, write_points, write_tweets
from .native import (TWEETS, assert_same_rows, key_str, run_native, run_script, run_stretch,
                     sorted_rows, tweet_source)

__all__ = ["TWEETS", "assert_same_rows", "key_str", "points_table", "publish", "run_native",
           "run_script", "run_stretch", "sorted_rows", "tweet_source", "tweets_table",
           "write_points", "write_tweets"]
