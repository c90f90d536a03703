# Two entry points (README): `make demo` and `make test`. Both build .venv on a fresh machine
# and are idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-cpu test-interp test-gpu bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CUDA machine keeps its own torch; a CPU machine takes the CPU wheel 2.13.0.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# matplotlib: the demo's PNG plot (4 s); transformers: tests/test_hf.py (12 s, from a wheel index)
	$(PY) -m pip install -q "triton==3.6.0" "numpy<2.4" "pytest>=8" "matplotlib>=3.7" "transformers>=4.45"
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: venv
	$(PY) -m tritium demo

test: test-cpu test-interp

test-cpu: venv
	$(PY) -m pytest -q -m "not interp and not gpu and not multigpu" tests

test-interp: venv
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interp tests

test-gpu:
	PYTHONPATH=$(CURDIR) python3 -m pytest -q -m "gpu or multigpu" tests

bench:
	PYTHONPATH=$(CURDIR) python3 -m tritium bench

clean:
	rm -rf $(VENV) .pytest_cache
