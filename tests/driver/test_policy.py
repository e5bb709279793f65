"""The elastic policy's decisions, and the rebalancing heuristic, on made-up batch figures."""

from __future__ import annotations

import numpy as np
import pytest

from spark_stretch.driver.elastic import merged
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
    with pytest.raises(ValueError, match="give parallelism=, owner_map= or key_groups="):
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
    run.batch_done(2, fig, written_at=None)  # (the first with input: the policy is not asked)
    with pytest.raises(RuntimeError, match=r"the elastic policy .*Broken.* failed on batch 3: "
                                           r"KeyError: 'oops'"):
        run.batch_done(3, fig, written_at=None)


# -- several hosts ----------------------------------------------------------------------------
G = 16


def _host(name, groups, group_load, par=2, u=0.6, demand=None, since=None):
    gl = np.zeros(G, np.int64)
    gl[groups] = np.asarray(group_load)[groups]
    return BatchMetrics(batch=5, parallelism=par, max_parallelism=2, utilization=[u] * par,
                        instances=list(range(par)), demand=demand, tuples=1000,
                        batches_since_switch=since, host=name, key_groups=list(groups),
                        group_load=gl)


def _hosts(*hosts, since_move=None):
    return merged(5, list(hosts), 2, G, since=None, since_move=since_move, switched=None)


def _moved(m, d):
    """The host loads after decision ``d`` (key groups moved), by host name."""
    owner = {g: m.hosts[i].host for g, i in enumerate(m.host_map)}
    owner.update(d.key_groups)
    out = {h.host: 0 for h in m.hosts}
    for g, n in enumerate(m.group_load):
        out[owner[g]] += int(n)
    return out


def test_a_hot_host_gives_its_heaviest_fitting_groups_to_the_least_loaded_host():
    load = np.array([300, 120, 80, 60, 40, 20, 10, 10] + [20] * 8)
    m = _hosts(_host("a", range(8), load), _host("b", range(8, 16), load))
    assert m.host_load == [640, 160] and m.host_imbalance == pytest.approx(1.6)
    d = ElasticPolicy().decide(m)
    # the gap is 480: the group closest to half of it (240) is group 0 (300); then a carries
    # 340 and b 460, 1.15 times the mean: done (worked out by hand)
    assert d == Decision("rebalance_hosts", key_groups={0: "b"})
    assert ElasticPolicy(rebalance_hosts_above=None).decide(m) is None
    # within the cool-down after a move: no move, each host's own decisions (none here)
    m = _hosts(_host("a", range(8), load), _host("b", range(8, 16), load), since_move=2)
    assert ElasticPolicy().decide(m) is None


def test_host_moves_end_within_theta_or_where_no_group_can_help():
    rng = np.random.default_rng(3)
    moves = 0
    for _ in range(300):
        load = rng.zipf(1.5, G).astype(np.int64) * rng.integers(1, 50, G)
        cut = int(rng.integers(1, G))
        m = _hosts(_host("a", range(cut), load), _host("b", range(cut, G), load))
        d = ElasticPolicy().decide(m)
        assert d is None or d.cause == "rebalance_hosts"
        owner = {g: m.hosts[i].host for g, i in enumerate(m.host_map)}
        owner.update(d.key_groups if d is not None else {})
        after = _moved(m, d) if d is not None else dict(zip("ab", m.host_load))
        busiest, least = max(after, key=after.get), min(after, key=after.get)
        if after[busiest] > 1.2 * sum(after.values()) / 2:
            # stopped above theta: no group of the busiest host moved to the other would
            # lower the busier of the two
            gap = after[busiest] - after[least]
            assert not [g for g in range(G) if owner[g] == busiest and 0 < load[g] < gap]
        if d is not None:
            moves += 1
            assert max(after.values()) < max(m.host_load)  # (it helped)
            assert all(owner[g] != m.hosts[m.host_map[g]].host for g in d.key_groups)
    assert moves > 100


def test_a_host_out_of_instances_gives_work_to_one_with_room():
    # keys nearly even (1.1), but a's instances (both running) are above 0.9 and b's two
    # would be at 0.35: a's work is 2 * 1.2 = 2.4 instances' for 550 keys, b's 0.7 for 450
    load = np.array([100, 100, 100, 100, 50, 50, 25, 25] + [50] * 8 + [0] * 0)[:G]
    load[8:] = [100, 100, 50, 50, 50, 50, 25, 25]
    a = _host("a", range(8), load, par=2, u=1.2, since=5)
    b = _host("b", range(8, 16), load, par=2, u=0.35, since=5)
    m = _hosts(a, b)
    assert m.host_imbalance < 1.2
    d = ElasticPolicy().decide(m)
    assert d.cause == "rebalance_hosts" and set(d.key_groups.values()) == {"b"}
    assert set(d.key_groups) <= set(range(8))
    # each host's work after the move at its own cost per key: a's at most 2 * 0.7 (its two
    # instances at the target), and b's not above a's before the move
    cost = {"a": 2.4 / 550, "b": 0.7 / 450}
    after = _moved(m, d)
    assert after["a"] * cost["a"] <= 2 * 0.7 + 1e-9
    moved = sum(load[g] for g in d.key_groups)
    assert 0.7 + moved * cost["b"] < 2.4
    # a host not yet at its max parallelism scales out instead
    a1 = _host("a", range(8), load, par=1, u=1.2, since=5)
    d = ElasticPolicy().decide(_hosts(a1, b))
    assert d == [Decision("scale_out", parallelism=2, host="a"),
                 Decision("scale_in", parallelism=1, host="b")]


def test_each_hosts_instances_are_decided_on_its_own_figures():
    load = np.full(G, 10)
    a = _host("a", range(8), load, par=1, u=1.5)
    b = _host("b", range(8, 16), load, par=2, u=0.6, since=1)  # (b: in its cool-down)
    assert ElasticPolicy().decide(_hosts(a, b)) == [Decision("scale_out", parallelism=2,
                                                             host="a")]
    b = _host("b", range(8, 16), load, par=2, u=0.1, since=3)
    assert ElasticPolicy().decide(_hosts(a, b)) == [
        Decision("scale_out", parallelism=2, host="a"),
        Decision("scale_in", parallelism=1, host="b")]


@pytest.mark.parametrize("kwargs,needle", [
    ({"rebalance_hosts_above": 1.0}, "rebalance_hosts_above=1.0 must be above 1"),
    ({"rebalance_hosts_above": -2}, "rebalance_hosts_above=-2 must be a positive number"),
    ({"rebalance_hosts_above": "x"}, "rebalance_hosts_above='x' must be a positive number"),
])
def test_bad_host_rebalancing_is_an_error_naming_the_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ElasticPolicy(**kwargs)
    with pytest.raises(ValueError, match="key_groups= moves key groups between hosts"):
        Decision("rebalance_hosts", key_groups={1: "a"}, host="a")
    with pytest.raises(ValueError, match=r"key_groups=\{\}"):
        Decision("rebalance_hosts", key_groups={})


def test_the_figures_of_several_hosts_and_their_switches():
    from spark_stretch.driver.elastic import ElasticRun
    from spark_stretch.driver.metrics import QueryMetrics

    run = ElasticRun(ElasticPolicy(), max_parallelism=2, metrics=QueryMetrics())

    def host(name, groups, busy, keys):
        return {"host": name, "key_groups": groups, "step_ms": 90.0, "since_ms": 100.0,
                "instances": list(range(len(busy))), "busy_ms": busy, "load": [keys] * len(busy),
                "parallelism": len(busy), "tuples": keys * len(busy), "input_rows": keys,
                "group_load": [[g, keys // len(groups)] for g in groups]}

    fig = {"key_groups": 4, "hosts": [host("a", [0, 1], [95.0], 800), host("b", [2, 3],
                                                                           [10.0], 200)]}
    run.batch_done(0, fig, written_at=None)  # (the first with input: the policy is not asked)
    assert run.pending(moves=True) == []
    m = run.batch_done(1, fig, written_at=None)
    assert [h.host for h in m.hosts] == ["a", "b"] and m.parallelism == 2
    assert m.group_load.tolist() == [400, 400, 100, 100] and m.host_map.tolist() == [0, 0, 1, 1]
    assert m.host_load == [800, 200] and m.host_imbalance == pytest.approx(1.6)
    assert m.utilization == [0.95, 0.1] and m.input_rows == 1000
    row = m.row()
    assert [h["load"] for h in row["hosts"]] == [800, 200] and row["host_imbalance"] == 1.6
    # (a takes 1.6 times the mean: one of its groups goes to b)
    assert run.pending(moves=True) == [Decision("rebalance_hosts", key_groups={0: "b"})]
    # a switch of one host's instances: that host's figures start again; a move: every host's
    run.switched({"cause": "scale_out", "host": "a", "parallelism": 2})
    m = run.batch_done(2, fig, written_at=None)
    assert [h.batches_since_switch for h in m.hosts] == [1, None]
    assert [h.switched for h in m.hosts] == ["scale_out", None] and m.switched == "scale_out"
    run.switched({"cause": "rebalance_hosts", "key_groups": {"a": 1, "b": 3}})
    m = run.batch_done(3, fig, written_at=None)
    assert [h.batches_since_switch for h in m.hosts] == [1, 1] and m.batches_since_move == 1
