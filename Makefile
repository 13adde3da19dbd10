# Set-up and entry points. Every target creates .venv (Python >= 3.12) and installs the
# project with the pinned versions in constraints.txt on first use.
#   make ablate   the main job
#   make test      the fast suite (every test not marked slow) on 2 worker processes
#   make test-all  the whole suite, slow tests included (what CI runs, with lint and docs)
#   make docs      the docs site into site/ (warnings are errors: a broken link fails)
#   make lint      ruff
#   make gpu-check the prepared GPU check (tools/gpu_check), results in runs/gpu-check

SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.installed
# First Python >= 3.12 found: python3.12 on PATH, pyenv's 3.12.1, python3.13, python3.
PYTHON := $(shell for c in "python3.12" "env PYENV_VERSION=3.12.1 python3.12" "python3.13" "python3"; do \
	$$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$$c"; break; }; done)

.PHONY: ablate formats test test-all lint docs gpu-check install clean

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYTHON)" || { echo "error: need Python >= 3.12 (python3.12 on PATH or pyenv 3.12.1)"; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e ".[test,docs]"
	touch $(STAMP)

install: $(STAMP)

ablate: $(STAMP)
	$(VENV)/bin/fmtkit ablate

formats: $(STAMP)
	$(VENV)/bin/fmtkit formats

# pytest-xdist: 2 workers (each test is independent and seeds its own randomness, so the
# results do not depend on which worker runs it); `worksteal` hands a worker that runs out of
# tests half of the other's queue, so a few minute-long tests at the end do not leave one core
# idle. `slow` marks end-to-end training runs, the
# model zoo's compiled training steps and the README examples: test-all runs them too.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal -m "not slow"

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal

lint: $(STAMP)
	$(VENV)/bin/ruff check fmtkit pallas_kernels studies tools tests examples

# mkdocs.yml sets strict: true, so a warning (a broken link or anchor, a docstring that
# mkdocstrings cannot parse, a name the API reference cannot find) fails the build. No --quiet:
# it drops the warnings before strict mode counts them, and a broken anchor then passes.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# A repo tool, not part of the installed package: run from the checkout (python -m).
gpu-check: $(STAMP)
	$(VENV)/bin/python -m tools.gpu_check runs/gpu-check

clean:
	rm -rf $(VENV) runs site .pytest_cache
