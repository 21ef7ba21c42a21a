# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/distbelief train --replicas 4 --shards 2 --optimizer adagrad --run-dir runs/demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=25

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
