# prefixlab: `make demo` runs the main job, `make test` runs the tests; both install into .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,dist
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -c $(VENV)/torch-constraint.txt "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -c $(VENV)/torch-constraint.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: install
	$(BIN)/prefixlab demo $(ARGS)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m pytest benchmarks --benchmark-enable -p no:cacheprovider $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check prefixlab tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks *.egg-info
