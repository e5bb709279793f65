"""A query on a real two-host Spark standalone cluster (workers on 127.0.0.2 and 127.0.0.3 of
this machine): one engine per executor host, each keeping its key groups, against native Spark.
The drivers run in their own processes (:mod:`.hosts_job`); the cluster is this module's.
Minutes each, none in the default run. CI's ``-m slow`` runs the user's own session builder
(Delta on the executors), the engine and executor kills, the drop-in on two hosts and a killed
driver; ``make test-soak`` the others: equality (a word count, intruders, stop()), routed rows,
key-group moves and ``stretch(df)``, a new host, a lost host, an elastic query moving key
groups by itself, the drop-in moving between one host and two, and pyspark's own drop-in and
transformWithState test files on the cluster (about 30 minutes together)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from spark_stretch.testing import run_script
from spark_stretch.testing.cluster import StandaloneCluster
from spark_stretch.testing.processes import driver_env

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("hosts_job.py")


@pytest.fixture(scope="module")
def cluster():
    with StandaloneCluster(hosts=("127.0.0.2", "127.0.0.3"), cores=1, memory="2g") as c:
        yield c


def _engine_pids() -> set:
    out = set()
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmd = Path(p).read_bytes()
        except OSError:
            continue
        if b"spark_stretch.host.daemon" in cmd and b"--tcp" in cmd:
            out.add(int(p.split("/")[2]))
    return out


def _engine_dirs() -> list:
    """The engines' directories on the cluster's hosts: in their executors' temporary directory
    (:class:`StandaloneCluster` gives each worker one), in /tmp (an executor's default), or
    /tmp's ``stretch-engine-<16 hex>`` where the first would make the socket's path too long
    for a Unix socket (``StretchHosts.engineDir``)."""
    tmp = tempfile.gettempdir()
    return (glob.glob(os.path.join(tmp, "stretch-cluster-*", "tmp*", "stretch-engine-app-*"))
            + glob.glob(os.path.join(tmp, "stretch-engine-app-*"))
            + glob.glob(os.path.join("/tmp", "stretch-engine-" + "[0-9a-f]" * 16)))


def _no_driver_path(settings: dict) -> None:
    """No executor setting names a file of this (the driver's) machine: on a real cluster the
    executors' machines do not have it."""
    bad = {k: v for k, v in settings.items()
           if re.search(r"(^|[\s=:,;'\"])(/|file:)", v) or os.path.isabs(v)}
    assert not bad, bad


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_two_hosts_equal_native_and_refuse_intruders(cluster, tmp_path):
    r = run_script(JOB, cluster.url, "equal", tmp_path, timeout=900)
    assert r["hosts"] == ["127.0.0.2", "127.0.0.3"]
    _no_driver_path(r["executor_settings"])
    # one engine per host, each owning half of the 16 key groups, each holding its windows
    hosts = r["wordcount_hosts"]
    assert sorted(h["host"] for h in hosts) == r["hosts"]
    assert [h["key_groups"] for h in hosts] == [8, 8]
    assert all(h["live_windows"] > 0 for h in hosts) and len({h["pid"] for h in hosts}) == 2
    assert r["wordcount_rows"] > 0
    # no challenge answered, garbage, or nothing: each connection closed without a reply,
    # and the query it ran beside equalled native Spark
    assert r["intruders_refused"] and all(r["intruders_refused"])
    # stop(): no engine process or directory left on either host
    assert r["engines_after_stop"] == []
    assert not _engine_dirs()


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_two_hosts_route_move_groups_and_run_stretch_df_as_native(cluster, tmp_path):
    r = run_script(JOB, cluster.url, "routes", tmp_path, timeout=900)
    assert r["paircount_rows"] > 0 and r["summax_rows"] > 0
    assert r["stretch_df_hosts"] == 2  # stretch(df) too, into Delta and a memory sink
    # reconfigure(key_groups=...) moved every group to one host and back, mid-stream, the
    # table equal to native Spark's
    assert "move_error" not in r, r.get("move_error")
    first, back = r["moves"]
    assert list(first["key_groups"].values()) == [16, 0] and first["moved_groups"] == 8
    assert list(back["key_groups"].values()) == [8, 8] and back["moved_groups"] == 8
    assert first["after_batch"] < back["after_batch"]
    # routed: a user's rows go to the host of that user only (the hosts share the 6000 rows)
    assert sum(r["summax_inputs"]) == 6000 and min(r["summax_inputs"]) > 0
    # a tweet reaches each host owning one of its words: at most once per host
    assert max(r["paircount_inputs"]) <= 6000
    assert r["engines_after_stop"] == []
    assert not _engine_dirs()


@pytest.mark.slow  # (80 s: the default run stays under 20 minutes; CI runs it with -m slow)
def test_a_users_own_builder_on_two_hosts_reads_delta_back_as_native(cluster, tmp_path):
    # configure_spark_with_stretch(builder, [kafka]): the shim and Delta as packages, shipped
    # by Spark (not the driver's paths), the user's package beside them; Delta written by
    # Spark's executors and by the engines, read back by Spark's executors, equal to native
    r = run_script(JOB, cluster.url, "configure", tmp_path, timeout=900)
    assert r["hosts"] == ["127.0.0.2", "127.0.0.3"]
    _no_driver_path(r["executor_settings"])
    jars = r["jars"]
    assert "spark-stretch-shim" in jars and "delta-spark_4.2" in jars, jars
    assert "spark-sql-kafka-0-10" in jars and "kafka-clients" in jars, jars
    assert r["spark_delta"] == [334, sum(range(0, 1000, 3))]
    assert r["wordcount_rows"] > 0 and r["direct_writes"]
    assert sorted(h["host"] for h in r["wordcount_hosts"]) == r["hosts"]
    # executors whose Python has no spark_stretch: a clear error naming a host and the module
    err = r["bare_error"]
    assert err and err.startswith("EngineStartError: spark-stretch cannot start its engine on "
                                  "executor host 127.0.0."), err
    assert "no module named 'spark_stretch'" in err and "On a cluster" in err, err


@pytest.mark.slow  # (a few minutes: make test-slow)
def test_engine_and_executor_killed(cluster, tmp_path):
    libs = "liblz4-java-*"
    in_tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), libs)))
    r = run_script(JOB, cluster.url, "faults", tmp_path, timeout=900)
    assert r["ok"] and (tmp_path / "engine-killed").exists()
    assert len(r["engine_restarts"]) == 1  # kill -9 of one host's engine mid-batch
    assert r["killed_executor"] > 0
    assert r["engines_after_stop"] == []
    # The executors unpack lz4 into their JVM's temporary directory, and one killed with -9
    # never deletes it: that directory is the cluster's (removed on stop), not this machine's
    # /tmp (where each slow run used to leave the killed executor's copy).
    assert glob.glob(str(cluster.path / "tmp*" / libs))
    new = set(glob.glob(os.path.join(tempfile.gettempdir(), libs))) - in_tmp
    assert not _left_behind(new), new


def _left_behind(paths: set) -> set:
    """Of ``paths`` (lz4 copies in /tmp, each ``.so`` with its ``.lck``), those that no running
    process maps: another Spark's JVM on this machine maps its own copy while it runs and
    deletes it when it exits; a copy that no process maps was left by a killed one."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(ln.split(maxsplit=5)[5].strip() for ln in f if "liblz4-java" in ln)
        except OSError:  # (the process ended meanwhile)
            pass
    return {p for p in paths if p.removesuffix(".lck") not in mapped}


@pytest.mark.slow  # (a few minutes: make test-slow)
def test_the_drop_in_on_two_hosts(cluster, tmp_path):
    # applyInPandasWithState's drop-in, two grouping columns, event-time timeouts: both hosts
    # hold keys; every key group moved to one host and back mid-stream; Delta (the engines
    # append) and a memory sink (Spark reads both hosts) equal to native Spark
    r = run_script(JOB, cluster.url, "grouped", tmp_path, timeout=900)
    assert "move_error" not in r, r.get("move_error")
    assert r["grouped_rows"] > 0 and r["grouped_closed"] > 0
    hosts = r["grouped_hosts"]
    assert sorted(h["host"] for h in hosts) == r["hosts"]
    assert all(h["state_keys"] > 0 and h["input_rows"] > 0 for h in hosts), hosts
    first, back = r["moves"]
    assert list(first["key_groups"].values()) == [0, 16] and first["moved_groups"] == 8
    assert list(back["key_groups"].values()) == [8, 8] and back["moved_groups"] == 8
    assert r["grouped_direct"] > 0
    # kill -9 of one host's engine mid-batch: restarted once, the table equal to native's
    assert r["grouped_killed"] and r["grouped_restarts"] == 1
    assert r["engines_after_stop"] == []


def _pyspark_tests_on(cluster, file: str, select) -> str:
    """Run ``tests/api/<file>`` (pyspark's own tests, ported), the ``-k select`` ones (None:
    all), with its session on this cluster; its pytest output."""
    env = dict(os.environ, STRETCH_TEST_MASTER=cluster.url, STRETCH_TEST_HOSTS="2",
               STRETCH_TEST_CONF="spark.executor.memory=1g,spark.executor.cores=1,"
               "spark.stretch.keyGroups=16,spark.driver.memory=1g")
    tests = Path(__file__).parents[1] / "api" / file
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-m", "slow or not slow", *(["-k", select] if select else []),
                        str(tests)], env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    return p.stdout


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_the_drop_in_moves_between_one_host_and_two(cluster, tmp_path):
    # one query, one checkpoint: 3 batches on one host (a local master: the engine's SipHash
    # placement), 3 on the two hosts (Spark's xxhash64: the state converted, each host keeping
    # its groups' keys), 3 on one host again (converted back): the table equal to native
    # Spark's run in the same phases
    phases = [("local[2]", ["one"]), (cluster.url, ["127.0.0.2", "127.0.0.3"]),
              ("local[2]", ["one"])]
    for i, (master, hosts) in enumerate(phases):
        r = run_script(JOB, master, "layout", tmp_path, timeout=900)
        assert r["layout_hosts"] == hosts, (i, r)
        assert all(k and k > 0 for k in r["layout_keys"]), (i, r)
    assert r["layout_rows"] > 0


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_pysparks_own_drop_in_tests_on_two_hosts(cluster):
    # tests/api/test_grouped_pyspark.py's drop-in side (pyspark's own applyInPandasWithState
    # tests, all of them): an engine on each host
    out = _pyspark_tests_on(cluster, "test_grouped_pyspark.py", "stretchApplyInPandasWithState")
    assert re.search(r"\b7 passed\b", out), out[-2000:]


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_pysparks_own_transform_with_state_tests_on_two_hosts(cluster):
    # tests/api/test_transform_pyspark.py (pyspark's own transformWithState tests, native and
    # through stretch(df)), all of them: an engine on each host, key groups across both
    # (but the map key schema's errors: Spark's planning on the driver, not the hosts)
    out = _pyspark_tests_on(cluster, "test_transform_pyspark.py", "not map_key_schema")
    assert re.search(r"\b23 passed\b", out), out[-2000:]


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_pysparks_own_state_variable_tests_on_two_hosts(cluster):
    # tests/api/test_transform_pyspark_state_variable.py (list, map, TTL; frames cut as
    # natively): an engine on each host
    out = _pyspark_tests_on(cluster, "test_transform_pyspark_state_variable.py", None)
    assert re.search(r"\b14 passed\b", out), out[-2000:]


@pytest.mark.slow  # a kill on the cluster: in `make test-slow`
def test_killed_driver_leaves_nothing(cluster, tmp_path):
    env = driver_env(tmp_path, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen([sys.executable, str(JOB), cluster.url, "hold", str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        deadline = time.time() + 300
        while not line.startswith("RESULT ") and time.time() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        held = json.loads(line[len("RESULT "):])["engines"]
        assert len(held) == 2 and set(held) <= _engine_pids()
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the driver, without a goodbye
        proc.wait()
    deadline = time.time() + 30  # (the engines' lease is 4 s)
    while (set(held) & _engine_pids() or _engine_dirs()) and time.time() < deadline:
        time.sleep(0.5)
    assert not set(held) & _engine_pids(), "an engine outlived its killed driver"
    assert not _engine_dirs()


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_a_new_host_given_key_groups(tmp_path):
    with StandaloneCluster(hosts=("127.0.0.2",), cores=1, memory="2g") as c:
        env = driver_env(tmp_path, PYSPARK_PYTHON=sys.executable)
        err = open(tmp_path / "stderr", "w")  # (a pipe nobody reads would fill and block it)
        proc = subprocess.Popen([sys.executable, str(JOB), c.url, "grow", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            for line in proc.stdout:
                if line.startswith("STARTED"):
                    c.add_worker("127.0.0.3")
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
            proc.wait(timeout=600)
            err.close()
            assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert r["hosts_before"] == ["127.0.0.2"]
    assert r["move"]["key_groups"] == {"127.0.0.2": 8, "127.0.0.3": 8}
    assert [h[:2] for h in r["hosts_after"]] == [["127.0.0.2", 8], ["127.0.0.3", 8]]
    assert all(h[2] > 0 for h in r["hosts_after"])  # (both took rows after the move)


def _imbalance(loads: dict, host_map: list) -> float:
    per = {}
    for g, n in loads.items():
        per[host_map[int(g)]] = per.get(host_map[int(g)], 0) + n
    got = [per.get(h, 0) for h in set(host_map)]
    return max(got) / (sum(got) / len(got))


@pytest.mark.soak  # (about 3 minutes; make test-soak; the policy's host moves: tests/driver/test_policy.py)
def test_elastic_moves_hot_key_groups_to_the_other_host(cluster, tmp_path):
    r = run_script(JOB, cluster.url, "elastic", tmp_path, timeout=900)
    assert r["ok"]  # (the table equal to native Spark's, in the job)
    moves = [c for c in r["reconfigurations"] if c["cause"] == "rebalance_hosts"]
    assert moves, r["reconfigurations"]
    last = moves[-1]
    assert len(last["host_map"]) == 16 and last["switch_ms"] > 0 and last["moved_groups"] > 0
    assert sum(last["key_groups"].values()) == 16
    # Independently of the engine's figures, from the input's keys per group (Spark's own
    # pmod(xxhash64(k), 16)): the first host map puts most keys on one host, the final one
    # within theta = 1.2, or the best that whole groups allow (every split of the 16 groups)
    loads = r["group_load"]
    assert _imbalance(loads, r["first_host_map"]) > 1.4
    best = min(_imbalance(loads, ["a" if s >> g & 1 else "b" for g in range(16)])
               for s in range(1, 1 << 15))  # (group 15 on "b": each split once)
    assert _imbalance(loads, last["host_map"]) <= max(1.2, best)
    # the engine's own figures agree: above theta before the first move, within it after
    rows = r["per_batch"]
    before = [b["host_imbalance"] for b in rows if b["batch"] <= moves[0]["after_batch"]]
    after = [b["host_imbalance"] for b in rows if b["batch"] > last["after_batch"]]
    assert before and min(before) > 1.4, rows
    assert after and max(after) <= max(1.2, best) + 0.05, rows
    # the drop-in on the same stream: the policy moved its groups too, to the same bound
    moves = [c for c in r["dropin_reconfigurations"] if c["cause"] == "rebalance_hosts"]
    assert moves, r["dropin_reconfigurations"]
    assert _imbalance(loads, moves[-1]["host_map"]) <= max(1.2, best)


@pytest.mark.soak  # (make test-soak: kept out of CI for its 90-minute budget)
def test_a_lost_host_s_key_groups_go_to_the_others(cluster, tmp_path):
    # (last in this module: it ends the cluster's worker on 127.0.0.3)
    r = run_script(JOB, cluster.url, "lose", tmp_path, timeout=900)
    assert r["ok"] and r["lost_after"] >= 2
    assert r["hosts_after"] == [["127.0.0.2", 16]]  # every group on the host that is left
    assert r["engine_restarts"] >= 1
    assert not _engine_pids()
    # What the killed engine left in its directory was on the lost host's disk (here its
    # worker's temporary directory, on this machine's disk): gone with the host
    for d in _engine_dirs():
        assert d.endswith("-127.0.0.3"), d
        shutil.rmtree(d)

