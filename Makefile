# The two commands of the README: `make train` (main job) and `make test` (the test suite).
# Both install what they need into .venv first (scripts/setup_env.sh; a no-op when up to date).
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup train test bench
setup:
	bash scripts/setup_env.sh

train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/mrl train $(ARGS)

test: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests -q $(PYTEST_ARGS)

bench: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/fwd_bwd_layouts.py
