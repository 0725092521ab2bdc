PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,torch]'
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not prefect and not slow" $(PYTEST_ARGS)

demo: venv
	$(BIN)/python -m ckpt.demo $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
