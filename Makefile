# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv on first use: the CPU build of torch first (so nothing pulls a CUDA build),
# then autoplan in editable mode with its test extras (pytest, transformers). The tests run in
# one worker per core (pytest-xdist): most are single-threaded planning or a few small ranks.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

.PHONY: demo test bench clean
demo: $(VENV)/.installed
	$(VENV)/bin/autoplan demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --dist worksteal

bench: $(VENV)/.installed
	$(PY) benchmarks/trace_scale.py

clean:
	rm -rf $(VENV) build dist *.egg-info
