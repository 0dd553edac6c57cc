# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Two workers, one a core: measured on 2 cores, as fast as three (5.5 min) and without the stalls that a
# third worker's load gives the tests' in-process agents. Each test file runs whole in one worker, so a
# file's servers (Slurm, etcd) start once.
TEST_WORKERS ?= 2

.PHONY: demo test install clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev,trainer,console,frameworks]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gridwatch demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
