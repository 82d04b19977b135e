# tfmulti: `make demo` runs the main job, `make test` runs lint and the tests.
# Both create (or reuse) the virtual environment in .venv themselves.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
DEMO_DIR ?= runs/demo

.PHONY: demo test test-profile lint format venv clean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e ".[dev]"
	touch $@

demo: venv
	rm -rf $(DEMO_DIR)
	$(BIN)/python scripts/train.py --strategy=pipeline --virtual_devices=4 \
		--num_stages=4 --microbatches=8 --schedule=1f1b --partition=time \
		--model=transformer --model_option=num_layers=6 --dataset=tokens \
		--batch_size=64 --epochs=3 --steps_per_epoch=5 --trace_steps=3,4 \
		--model_dir=$(DEMO_DIR)

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Whole files to each worker, slowest first (tests/conftest.py), so the run ends on short
# files; --durations=10: the ten slowest tests end the log, so a slow newcomer shows.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist=loadfile --no-loadscope-reorder --timeout=900 \
		-o faulthandler_timeout=120 --durations=10 tests

# The suite's time per test, file and promise in runs/test-profile/profile.{md,json}, and
# each file's seconds in tests/file_seconds.json (commit it when the order changed).
test-profile: venv
	$(BIN)/python tests/suite_profile.py --out=runs/test-profile \
		--file_seconds=tests/file_seconds.json

clean:
	rm -rf $(VENV) runs build *.egg-info
