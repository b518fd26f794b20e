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

test: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests -q --durations=40 $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests/unit -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/python -m ruff check .

bench: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/fwd_bwd_layouts.py

image:
	bash docker/build_image.sh $(IMAGE)
