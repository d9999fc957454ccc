# Quick start: `make demo` trains on 2 local MPI ranks; `make test` runs the whole suite.
# Both set up a local .venv on first use (CPU torch 2.13.0, mpi4py, the PyPI MPICH wheel).
# On a cluster with its own MPI, use `make setup EXTRAS=test,plot` (no PyPI MPICH) instead.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,plot,mpich
STAMP := $(VENV)/.hpcadapt-installed
# The venv's mpiexec (from the mpich wheel) when present, else the site's.
MPIEXEC = $(if $(wildcard $(VENV)/bin/mpiexec),$(VENV)/bin/mpiexec,mpiexec)
TIMEOUT := timeout --signal=KILL
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup demo test test-unit test-mpi test-train bench clean

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pin the CPU build first so no dependency range pulls the CUDA build of torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(MPIEXEC) -n 2 $(PY) -m hpcadapt.train --model mlp --dataset digits --epochs 5 \
		--metrics-file demo-metrics.jsonl

test: $(STAMP) test-unit test-mpi

test-unit: $(STAMP)
	$(TIMEOUT) 2400 $(PYTEST) -q --timeout=600 tests

test-mpi: $(STAMP)
	$(TIMEOUT) 600 $(MPIEXEC) -n 2 $(PYTEST) -q --with-mpi -m mpi --timeout=300 tests
	$(TIMEOUT) 900 $(MPIEXEC) -n 4 $(PYTEST) -q --with-mpi -m mpi --timeout=300 tests

bench: $(STAMP)
	$(PY) benchmarks/run.py all --json bench-results.json

clean:
	rm -rf $(VENV) *.egg-info demo-metrics.jsonl
