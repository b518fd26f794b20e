# The README's commands: `make train` (main job), `make test` (the test suite, what CI runs),
# `make test-fast` (unit tests and the fake SGLang server: the inner loop) and `make lint` (ruff).
# Both install what they need into .venv first (scripts/setup_env.sh; a no-op when up to date).
# `make image` builds the CPU container image with podman (docker/build_image.sh; docker/README.md).
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup train test test-fast lint bench image
setup:
	bash scripts/setup_env.sh

train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/mrl train $(ARGS)

# The unit and torchrun tiers run on two pytest-xdist workers (their tests are single-threaded processes, so
# two keep both cores busy); the tiers with engines, runs and Slurm run one test at a time, as their engines
# and timings assume. Both tiers run even when the first fails; make fails if either did (a tier where
# PYTEST_ARGS selects nothing, pytest's exit 5, is not a failure).
PARALLEL_TIERS = tests/unit tests/distributed

test: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest $(PARALLEL_TIERS) -q -n 2 --durations=20 $(PYTEST_ARGS); \
	a=$$?; OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests -q $(addprefix --ignore=,$(PARALLEL_TIERS)) \
	--durations=40 $(PYTEST_ARGS); b=$$?; for rc in $$a $$b; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit 1; done

test-fast: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests/unit -q -n 2 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/python -m ruff check .

bench: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/fwd_bwd_layouts.py

image:
	bash docker/build_image.sh $(IMAGE)
