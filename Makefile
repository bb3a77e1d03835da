# make test: the whole suite. make demo: a real transfer against embedded servers.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test demo lint format check-java venv bytecode clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required (found %s)" % sys.version.split()[0])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# Bytecode for our sources, as a non-editable pip install leaves it: every Spark
# Python worker imports them, and with PYTHONDONTWRITEBYTECODE set each one would
# compile them again (about 0.3 CPU-s per process). Only changed files recompile.
bytecode: venv
	@$(PY) -m compileall -q spark_dilation pyspark_dilation.py

check-java:
	@sh conf/check-java.sh

test: venv bytecode check-java
	$(PY) -m ruff check .
	$(PY) -m pytest

demo: venv bytecode check-java
	$(VENV)/bin/spark-dilation demo

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
