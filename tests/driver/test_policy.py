"""The elastic policy's decisions, and the rebalancing heuristic, on made-up batch figures."""

from __future__ import annotations

import numpy as np
import pytest

from spark_stretch.driver.policy import (BatchMetrics, Decision, ElasticPolicy, Policy,
                                         as_policy, rebalanced)
from spark_stretch.protocol.placement import balanced_owner_map


def _m(u, par=2, top=4, since=None, demand=None, **kw):
    kw.setdefault("tuples", 1000)
    return BatchMetrics(batch=5, parallelism=par, max_parallelism=top, utilization=u,
                        batches_since_switch=since, demand=demand, **kw)


def test_scaling_aims_at_the_target_within_the_bounds():
    p = ElasticPolicy()
    assert p.decide(_m([0.95, 0.99])) == Decision("scale_out", parallelism=3)  # ceil(2*.97/.7)
    assert p.decide(_m([3.0, 3.0])).parallelism == 4                           # (max)
    assert p.decide(_m([0.3, 0.3], par=4)) == Decision("scale_in", parallelism=2)
    assert p.decide(_m([0.01], par=1)) is None                                 # (min)
    assert p.decide(_m([0.6, 0.7])) is None                                    # in the band
    assert ElasticPolicy(max_parallelism=3).decide(_m([3.0, 3.0])).parallelism == 3
    assert ElasticPolicy(min_parallelism=2).decide(_m([0.1, 0.1], par=3)).parallelism == 2


def test_the_input_demand_decides_before_the_measured_utilization():
    p = ElasticPolicy()
    # the step still processed a high batch, but the rows that came in are few: scale in now
    assert p.decide(_m([2.0, 2.0], demand=0.05)) == Decision("scale_in", parallelism=1)
    # the step processed little, but many rows came in: scale out now
    assert p.decide(_m([0.1], par=1, demand=2.0)) == Decision("scale_out", parallelism=3)


def test_no_decision_during_the_cooldown():
    p = ElasticPolicy(cooldown_batches=2)
    assert p.decide(_m([2.0, 2.0], since=1)) is None
    assert p.decide(_m([2.0, 2.0], since=2)) is None
    assert p.decide(_m([2.0, 2.0], since=3)).cause == "scale_out"
    assert ElasticPolicy(cooldown_batches=0).decide(_m([2.0, 2.0], since=1)).cause == "scale_out"


def test_imbalance_above_theta_rebalances_ownership_only():
    B = 64
    om = balanced_owner_map(B, [0, 1])
    load = np.ones(B, np.int64)
    load[3] = 40  # a hot bucket of instance 0
    inst = np.bincount(om, weights=load, minlength=2)
    m = _m([0.6, 0.6], imbalance=float(inst.max() / inst.mean()), instances=[0, 1],
           bucket_load=load, owner_map=om)
    d = ElasticPolicy().decide(m)
    assert d.cause == "rebalance" and d.parallelism is None
    new = np.asarray(d.owner_map)
    after = np.bincount(new, weights=load, minlength=2)
    assert after.max() / after.mean() <= 1.2 and set(new) == {0, 1}
    assert ElasticPolicy(rebalance_above=None).decide(m) is None
    assert ElasticPolicy(rebalance_above=2.0).decide(m) is None


def test_rebalanced_moves_nothing_when_no_move_helps():
    assert rebalanced([10, 0, 0, 0], [0, 0, 1, 1], [0, 1], 1.2) is None  # one bucket: stuck
    assert rebalanced([1, 1, 1, 1], [0, 0, 1, 1], [0, 1], 1.2) is None   # balanced already
    out = rebalanced([4, 3, 2, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 1], 1.05)
    loads = np.bincount(out, weights=[4, 3, 2, 1, 0, 0], minlength=2)
    assert loads.tolist() == [5.0, 5.0]


def test_elastic_argument():
    assert as_policy(None, 4) is None and as_policy(False, 4) is None
    assert isinstance(as_policy(True, 4), ElasticPolicy)

    class Mine(Policy):
        def decide(self, metrics):
            return None

    mine = Mine()
    assert as_policy(mine, 4) is mine
    with pytest.raises(ValueError, match="min_parallelism=3 is above the query's "
                                         "max_parallelism=2"):
        as_policy(ElasticPolicy(min_parallelism=3), 2)
    with pytest.raises(ValueError, match="Decision: cause='manual'"):
        Decision("manual", parallelism=2)
    with pytest.raises(ValueError, match="give parallelism= or owner_map="):
        Decision("scale_out")


def test_a_batch_that_measured_nothing_decides_nothing():
    assert ElasticPolicy().decide(_m([5.0], par=1, tuples=0)) is None  # (a first step, say)
    assert ElasticPolicy().decide(_m([5.0], par=1, tuples=10)).cause == "scale_out"


def test_a_failing_policy_is_named_with_its_batch():
    from spark_stretch.driver.elastic import ElasticRun
    from spark_stretch.driver.metrics import QueryMetrics

    class Broken(Policy):
        def decide(self, metrics):
            raise KeyError("oops")

    run = ElasticRun(Broken(), max_parallelism=2, metrics=QueryMetrics())
    fig = {"step_ms": 1.0, "instances": [0], "busy_ms": [0.5], "parallelism": 1, "tuples": 1}
    with pytest.raises(RuntimeError, match=r"the elastic policy .*Broken.* failed on batch 3: "
                                           r"KeyError: 'oops'"):
        run.batch_done(3, fig, written_at=None)
