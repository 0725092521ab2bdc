PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv lint test test-fast soak demo docs bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,torch,lint,hf,lightning,docs]'
	touch $(STAMP)

# ruff (rules in pyproject's [tool.ruff]), the import layers (import-linter), types of core/ and db/
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# two pytest workers (pytest-xdist), a module per worker at a time (module-scoped servers stay
# shared): most integration time is spent waiting on servers and agents, so the suite takes about
# half its serial time on 2 cores. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadfile)

test: venv
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# the fault soak, long: CKPT_SOAK_EXAMPLES / CKPT_SOAK_STEPS / CKPT_SOAK_SEED (replay) / CKPT_SOAK_FAULTS
soak: venv
	CKPT_SOAK_SEED=$${CKPT_SOAK_SEED:-random} CKPT_SOAK_EXAMPLES=$${CKPT_SOAK_EXAMPLES:-400} CKPT_SOAK_STEPS=$${CKPT_SOAK_STEPS:-60} \
	CKPT_SOAK_REPORT=$${CKPT_SOAK_REPORT:-soak-report.json} $(BIN)/python -m pytest tests/soak -o timeout=0 $(PYTEST_ARGS)

demo: venv
	$(BIN)/python -m ckpt.demo $(ARGS)

# the docs site (mkdocs-material) into build/site: the configuration and CLI references are
# regenerated from the code first; --strict fails on a broken link or a page left out of the nav
docs: venv
	$(BIN)/python -m scripts.reference_docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
