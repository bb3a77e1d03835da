# make test: the whole suite. make demo: a real transfer against embedded servers.
# Both create .venv and install what they need on a fresh machine.
# make test-oldest: a smoke run on the oldest supported PySpark (4.0.x) in its own venv.
# make test-multimachine: the namespace-cluster and compose tests alone (make test's last step).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# Test tools are pinned (conf/test-constraints.txt); either file changing makes a new venv.
CONSTRAINTS = conf/test-constraints.txt
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml $(CONSTRAINTS) | cksum | cut -d' ' -f1)

# pytest keeps its base temps in one folder per user and, at each session's end,
# removes all but the newest three: another run on the machine (another clone's
# make check) removed a running suite's base temp. Each checkout gets its own root,
# short: Unix socket paths under it must fit 108 bytes or take the long-path way.
ifndef PYTEST_DEBUG_TEMPROOT
PYTEST_DEBUG_TEMPROOT := /tmp/sd-$(shell printf %s "$(CURDIR)" | cksum | cut -d' ' -f1)
endif
export PYTEST_DEBUG_TEMPROOT
$(shell mkdir -p $(PYTEST_DEBUG_TEMPROOT))

.PHONY: jvm-archive test test-multimachine check test-oldest venv-oldest demo lint format check-java venv bytecode clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required (found %s)" % sys.version.split()[0])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# Bytecode for our sources, as a non-editable pip install leaves it: every Spark
# Python worker imports them, and with PYTHONDONTWRITEBYTECODE set each one would
# compile them again (about 0.3 CPU-s per process). Only changed files recompile.
# The same for PySpark in Spark's Python workers: they put PySpark's source zip
# first on their path and compiled it at every start (spark_dilation/testing/worker_bytecode.py).
bytecode: venv
	@$(PY) -m compileall -q spark_dilation pyspark_dilation.py
	@$(PY) -m spark_dilation.testing.worker_bytecode 2>/dev/null

check-java:
	@sh conf/check-java.sh

# The suite runs on TEST_WORKERS pytest-xdist workers: many tests wait on timers
# and networks, so more workers than cores keep 2 cores busy. 4 workers were
# faster (1280 s against 1374 s, before the streaming tests) but kept the load
# average at 13-19 on 2 cores, where the liveness bounds (docs/transfer.md) and
# Spark's fixed 10 s for a fresh Python worker to connect back failed runs.
# loadgroup keeps the namespace clusters' tests on one worker (one set of clusters
# at a time), Spark Connect's on one (port 15002), the streaming pairs on one.
TEST_WORKERS ?= 3

# SPARK_DILATION_JVM_ARCHIVE: a folder for a class-data archive of Spark's classes
# (spark_dilation/testing/jvm_archive.py), built once for each JDK and PySpark
# (jvm-archive, below): each test JVM's start-up then takes about half the CPU.
JVM_ARCHIVE_DIR ?= build/jvm

# Built before the Spark tests, not beside their first minute (whose JVMs then
# start on the archive, with no build competing); make test runs the pure tests
# meanwhile.
jvm-archive: venv
	@$(PY) -m spark_dilation.testing.jvm_archive $(JVM_ARCHIVE_DIR) >/dev/null

# make test runs in steps by the resource each needs, each with its own JUnit report:
# 1. ruff, then the pure tests (no Spark, no server processes: make check's) on
#    2 workers while the JVM archive builds beside them;
# 2. the tests marked "alone", with the machine to themselves: the stream notebook
#    plays two clusters in one local[2] JVM, and Spark gives each fresh Python
#    worker a fixed 10 s to connect back, which the suite's load can take;
# 3. the rest of the suite (Spark, servers, CLIs, the reference peer) on
#    TEST_WORKERS workers;
# 4. make test-multimachine: the namespace clusters and the compose files, one
#    test at a time, so their liveness bounds meet no other load.
PYTEST_STEP = SPARK_DILATION_JVM_ARCHIVE=$(JVM_ARCHIVE_DIR) $(PY) -m pytest
test: venv bytecode check-java
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@mkdir -p build
	@$(PY) -m spark_dilation.testing.jvm_archive $(JVM_ARCHIVE_DIR) >build/jvm-archive.log 2>&1 & \
	  archive=$$!; \
	  $(PY) -m pytest -n 2 -m "not integration" --junitxml=build/junit-pure.xml; pure=$$?; \
	  wait $$archive || { echo "the JVM archive build failed: build/jvm-archive.log"; tail -20 build/jvm-archive.log; exit 1; }; \
	  exit $$pure
	$(PYTEST_STEP) -m alone --junitxml=build/junit-alone.xml
	$(PYTEST_STEP) -n $(TEST_WORKERS) --dist loadgroup -m "integration and not alone and not multimachine" \
		--junitxml=build/junit.xml
	$(MAKE) --no-print-directory test-multimachine

test-multimachine: venv bytecode check-java jvm-archive
	$(PYTEST_STEP) -m multimachine --junitxml=build/junit-multimachine.xml

# The inner loop: lint and the tests that need no Spark, no server processes and
# no processes of their own (about a minute).
check: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 -m "not integration" --durations=10

# The oldest PySpark the [spark] extra allows, in its own venv: .[test-tools] brings
# the newest PySpark, so the constraint keeps pyspark at 4.0.x while pip
# resolves everything else. The smoke run covers the schema conversions 4.0
# does differently, a Spark->Spark transfer with exact content, a Python
# source into Spark, one Spark Connect transfer, and streams: killed at each
# batch phase (4.0 plans (L, L) on restart) and the guide's examples (about 4 minutes);
# SPARK_DILATION_EXPECT_PYSPARK makes tests/test_pyspark_version.py fail if the
# run did not use that PySpark (Spark's workers run this venv's Python too).
OLDEST_PYSPARK = 4.0
OLDEST_VENV   ?= .venv-pyspark40
OLDEST_PY      = $(OLDEST_VENV)/bin/python
OLDEST_STAMP   = $(OLDEST_VENV)/.installed-$(shell (cat pyproject.toml $(CONSTRAINTS); echo $(OLDEST_PYSPARK)) | cksum | cut -d' ' -f1)
OLDEST_TESTS   = tests/test_pyspark_version.py \
	tests/test_spark_files.py::test_nested_nullability_survives_both_ways \
	tests/test_spark_files.py::test_rarer_arrow_types_are_cast \
	tests/test_spark_transfer.py::test_spark_to_spark_all_types_exact \
	tests/test_spark_transfer.py::test_python_table_and_parquet_into_spark \
	tests/test_spark_connect.py::test_register_on_a_classic_session_is_idempotent \
	tests/test_spark_connect.py::test_classic_writer_to_connect_reader \
	tests/test_spark_stream.py::test_a_small_stream_arrives_exactly \
	tests/test_spark_stream.py::test_stream_survives_kills_at_each_batch_phase_exactly_once \
	tests/test_spark_stream.py::test_the_guide_examples_on_the_sink_and_the_source

venv-oldest: $(OLDEST_STAMP)

$(OLDEST_STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required (found %s)" % sys.version.split()[0])'
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	(cat $(CONSTRAINTS); echo 'pyspark==$(OLDEST_PYSPARK).*') > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_PY) -m pip install --quiet -c $(OLDEST_VENV)/constraints.txt 'pyspark[connect]==$(OLDEST_PYSPARK).*'
	$(OLDEST_PY) -m pip install --quiet -c $(OLDEST_VENV)/constraints.txt -e '.[test-tools]'
	rm -f $(OLDEST_VENV)/.installed-*
	touch $@

test-oldest: venv-oldest check-java
	@$(OLDEST_PY) -m compileall -q spark_dilation pyspark_dilation.py
	@$(OLDEST_PY) -m spark_dilation.testing.worker_bytecode 2>/dev/null
	@$(OLDEST_PY) -c 'import pyspark; print("PySpark", pyspark.__version__, "in", "$(OLDEST_VENV)")'
	@$(OLDEST_PY) -m spark_dilation.testing.jvm_archive $(JVM_ARCHIVE_DIR)-oldest >/dev/null
	SPARK_DILATION_EXPECT_PYSPARK=$(OLDEST_PYSPARK) SPARK_DILATION_JVM_ARCHIVE=$(JVM_ARCHIVE_DIR)-oldest \
		$(OLDEST_PY) -m pytest -n 2 --dist loadgroup $(OLDEST_TESTS)

demo: venv bytecode check-java
	$(VENV)/bin/spark-dilation demo

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
