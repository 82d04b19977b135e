# tfmulti: `make demo` runs the main job, `make test` runs lint and the tests.
# Both create (or reuse) the virtual environment in .venv themselves.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
DEMO_DIR ?= runs/demo

.PHONY: demo test lint format venv clean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: venv
	rm -rf $(DEMO_DIR)
	$(BIN)/python scripts/train.py --strategy=mirrored --virtual_devices=4 \
		--model=convnet --dataset=digits --batch_size=128 --epochs=8 \
		--learning_rate=0.003 --model_dir=$(DEMO_DIR)

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -q -n 2 --durations=15 tests

clean:
	rm -rf $(VENV) runs build *.egg-info
