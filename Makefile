# spark-stretch: everything a fresh machine needs, from a clean clone.
#   make demo   set up (venv, packages, shim jar, Delta jars) and run the demo
#   make test   set up and run the default test suite (make test-slow: kills, restarts, the
#               cluster, Kafka; CI runs both. make test-soak: the longest, outside CI)
#   make bench  set up and run the benchmarks (not part of the tests)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
export SPARK_LOCAL_IP ?= 127.0.0.1
export PYSPARK_PYTHON := $(abspath $(PY))

.PHONY: setup demo test test-slow test-soak bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m spark_stretch.driver > $(VENV)/setup-jars.txt
	$(PY) -m spark_stretch warm
	touch $@

demo: setup
	$(PY) examples/wordcount_delta.py

test: setup
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -W ignore::FutureWarning --durations=25

test-slow: setup
	$(PY) -m pytest -q -W ignore::FutureWarning --durations=15 -m "slow and not soak"

# The longest tests, outside CI's 90-minute budget (about an hour and a half here).
test-soak: setup
	$(PY) -m pytest -q -W ignore::FutureWarning --durations=15 -m soak

# The figures in BENCHMARKS.md (long: the pair-count run alone takes ~14 minutes; each checks
# its outputs equal the baseline's and prints its results).
bench: setup
	$(PY) python/bench/shim.py
	$(PY) python/bench/engine.py
	$(PY) python/bench/spark.py --tweets 1000000 --queries wordcount --repeat 5
	$(PY) python/bench/spark.py --tweets 1000000 --queries paircount-H
	$(PY) python/bench/spark.py --tweets 1000000 --queries wordcount --repeat 5 --source delta
	$(PY) python/bench/ingest.py --repeat 5
	$(PY) python/bench/join.py
	$(PY) python/bench/checkpoint.py
	$(PY) python/bench/aggstate.py --keys 1000000
	$(PY) python/bench/recovery.py --tweets 20000
	$(PY) python/bench/grouped.py --events 100000
	$(PY) python/bench/transform.py --events 300000 --users 30000
	$(PY) python/bench/elastic.py
	$(PY) python/bench/nexmark.py --events 10000000 --repeat 3
	$(PY) python/bench/nexmark_path.py --events 10000000 --repeat 3 --queries q17,q5 --busy
	$(PY) python/bench/latency.py --plot docs/nexmark-latency.png

clean:
	rm -rf $(VENV) build dist *.egg-info
