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

# `tests/unit` and `tests/distributed` run side by side as two pytest processes, each one test at a time: the
# unit tests are single-threaded, and one torchrun job at a time beside them keeps both cores busy (xdist's two
# workers would put two multi-rank jobs on the 2 cores at once). The distributed tier's output is printed when
# both end. Then the tiers with engines, runs and Slurm run one test at a time, as their engines and timings
# assume. Every tier runs even when another fails; make fails if any did (a tier where PYTEST_ARGS selects
# nothing, pytest's exit 5, is not a failure).
DIST_LOG = runs/test-distributed.log

test: setup
	@mkdir -p $(dir $(DIST_LOG))
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests/distributed -q --durations=20 $(PYTEST_ARGS) \
	> $(DIST_LOG) 2>&1 & d=$$!; \
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests/unit -q --durations=20 $(PYTEST_ARGS); a=$$?; \
	echo "[make test] tests/distributed (started beside tests/unit), its output:"; wait $$d; b=$$?; \
	cat $(DIST_LOG); \
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests -q --ignore=tests/unit --ignore=tests/distributed \
	--durations=40 $(PYTEST_ARGS); c=$$?; \
	for rc in $$a $$b $$c; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit 1; done

test-fast: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests/unit -q -n 2 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/python -m ruff check .

bench: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/fwd_bwd_layouts.py

image:
	bash docker/build_image.sh $(IMAGE)
