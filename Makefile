# Two set-up commands for a fresh machine: `make demo` and `make test`. Both create .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch
DOCS_STAMP := $(VENV)/.installed-docs
LINT_STAMP := $(VENV)/.installed-lint

.PHONY: demo test test-slow test-opacus test-opacus-baseline bench install docs lint clean

# the venv and torch once; the package and its extras again only when pyproject.toml changes
$(TORCH_STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU build of PyTorch on these machines; the package itself only needs torch>=2.6.
	$(BIN)/pip install --quiet torch==2.13.0
	touch $(TORCH_STAMP)

$(STAMP): pyproject.toml | $(TORCH_STAMP)
	$(BIN)/pip install --quiet -e '.[test,hf]'
	# bytecode now, as a non-editable install would: each test worker and spawned process would compile src again
	$(BIN)/python -m compileall -q src
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/idpsgd demo --seed 0 --overwrite --out runs/demo

# pytest-xdist: one worker per core, a file per worker at a time (a file's module fixtures made once; see
# tests/conftest.py).  `python -m pytest` alone runs the same tests in one process.
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n auto --dist loadfile

# the long end-to-end versions (deselected by default in pyproject.toml)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# Opacus 1.6's own PrivacyEngine tests with idpsgd's engine swapped in (tests/opacus_suite, issue 31):
# prints "opacus suite: N passed, N refused, N other, N skipped" and fails on any "other".  Not part of
# `make test`.  torchvision goes to $(OPACUS_SITE), outside .venv: PyPI's build cannot load its C
# operators beside the CPU torch (the harness declares the two it needs; see tests/opacus_suite/harness.py).
OPACUS_SITE := .opacus-suite
TORCHVISION := torchvision==0.28.0

$(OPACUS_SITE)/torchvision: $(STAMP)
	$(BIN)/pip install --quiet -e '.[opacus-suite]'
	$(BIN)/pip install --quiet --no-deps --target $(OPACUS_SITE) $(TORCHVISION)

test-opacus: $(OPACUS_SITE)/torchvision
	$(BIN)/python tests/opacus_suite/run.py --site $(OPACUS_SITE)

# the same tests on Opacus's own PrivacyEngine (all pass: the harness itself is sound)
test-opacus-baseline: $(OPACUS_SITE)/torchvision
	$(BIN)/python tests/opacus_suite/run.py --site $(OPACUS_SITE) --baseline

bench: $(STAMP)
	$(BIN)/python bench/run.py

# the documentation site (mkdocs.yml, docs/): --strict fails on a broken link, anchor or API name; output in site/
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# ruff (configured in pyproject.toml): lint and the formatter's check, over the whole repository
$(LINT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[lint]'
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(OPACUS_SITE) build dist site src/*.egg-info
