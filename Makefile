# megagrpo: `make test` and `make demo` are the two commands a new user needs; both install
# what they need the first time. The dependencies live outside the clone, in a venv in a cache keyed
# by the lock's hash, so a fresh clone with an unchanged lock reuses it in seconds; each clone's `.venv`
# layers its own code over it (see `setup`).
SHELL := /bin/bash
.DEFAULT_GOAL := help

LOCK      := requirements/lock-cpu.txt
UV_PIN    := uv==0.13.9
CACHE_DIR ?= $(HOME)/.cache/megagrpo
LOCK_HASH := $(shell sha256sum $(LOCK) | cut -c1-16)
VENV      := $(CACHE_DIR)/venv-$(LOCK_HASH)
PY        := .venv/bin/python
PYTEST_ARGS ?=

# Python 3.12: `python3.12` on PATH if it really runs, else pyenv's 3.12.1.
PYTHON312 := $(shell for p in python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v $$p; break; }; done)

# uv reads its own index settings (UV_DEFAULT_INDEX, UV_INDEX_URL, uv.toml) and never pip's. When none of
# uv's is set but pip has an index (PIP_INDEX_URL or index-url in pip.conf, e.g. a company mirror), the
# installing targets export it to uv, unechoed since it may carry credentials; else uv's own default (PyPI).
UV_CONFIG := $(wildcard $(or $(XDG_CONFIG_HOME),$(HOME)/.config)/uv/uv.toml /etc/uv/uv.toml uv.toml)
PIP_INDEX  = $(or $(PIP_INDEX_URL),$(shell $(PYTHON312) -m pip config list 2>/dev/null \
	| sed -n "s/^\(install\|global\)\.index-url='\(.*\)'$$/\1 \2/p" | sort -r | head -1 | cut -d' ' -f2-))
ifeq ($(UV_DEFAULT_INDEX)$(UV_INDEX_URL)$(UV_CONFIG),)
$(VENV)/.installed lock: export UV_DEFAULT_INDEX = $(PIP_INDEX)
endif

.PHONY: help setup test test-gpu test-fast lint fmt demo demo-agentic demo-clean lock clean-venv

help:
	@echo "make test   install (first time) and run the whole test suite"
	@echo "make demo   install (first time) and run the tiny GRPO demo on this CPU"
	@echo "make demo-agentic  the same with multi-turn tool use (a calculator), SFT on traces then GRPO"
	@echo "make lint   ruff check + format check"
	@echo "make test-gpu  the GPU tier (tests/gpu) on one CUDA device"
	@echo "make lock   re-resolve requirements/cpu.in into $(LOCK)"

# Each clone runs its own code. The shared venv holds the dependencies only (megagrpo is not installed in
# it); `.venv` is a small venv of this clone's own over it (tools/clone_venv.py: the clone's root and the
# shared site-packages on its path, its own `megagrpo`), so `megagrpo`, `.venv/bin/python` and every launch
# that starts `sys.executable` (torchrun, srun, the Slurm templates' python) import this clone's package,
# whichever clone set up last. Redone when the shared venv, the clone's path or clone_venv.py itself changes
# (the stamp holds all three: a clone set up by an earlier recipe gets the current console script); a
# second run is instant.
OVERLAY_OF = $(VENV) $(CURDIR) $(shell sha256sum tools/clone_venv.py | cut -c1-16)
setup: $(VENV)/.installed
	@[ ! -L .venv ] && [ "$$(cat .venv/.overlay-of 2>/dev/null)" = "$(OVERLAY_OF)" ] \
	  || $(VENV)/bin/python tools/clone_venv.py $(VENV) $(CURDIR)

# Order-only: the venv's path already carries the lock's hash, so a changed lock means another venv. A
# time-based rule would rebuild (and delete) the shared venv on every fresh clone, whose lock file is
# always newer than the stamp.
$(VENV)/.installed: | $(LOCK)
	@if [ -z "$(PYTHON312)" ]; then \
	  echo "error: Python 3.12 not found. Install it (e.g. 'pyenv install 3.12.1') or put python3.12 on PATH." >&2; exit 1; fi
	@echo "==> creating $(VENV) with $(PYTHON312)"
	@rm -rf $(VENV) && mkdir -p $(CACHE_DIR)
	$(PYTHON312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check "$(UV_PIN)"
	@echo "==> installing the pinned set ($(LOCK)); SGLang by the CPU route (no CUDA-only kernels)"
	$(VENV)/bin/python -m uv pip install --python $(VENV)/bin/python --no-deps -r $(LOCK)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "==> GPU present: installing the gpu extra"; \
	  $(VENV)/bin/python -m uv pip install --python $(VENV)/bin/python ".[gpu]"; fi
	@touch $@

demo: setup
	$(PY) tools/run_demo.py $(DEMO_ARGS)

# The multi-turn counterpart: the tiny model learns to multiply by calling the calculator tool (README).
# It resumes like `make demo`; `rm -rf outputs/agentic` starts over.
demo-agentic: setup
	$(PY) tools/run_demo.py --config configs/agentic_calculator.yaml $(DEMO_ARGS)

demo-clean:
	rm -rf outputs/demo

# Integration files run one pytest process each: they start SGLang engines, megatron meshes and Slurm
# daemons in-process, and a fresh process per file keeps one file's process state out of the next. The
# exception is the files that use the session's SGLang engine (`sglang_engine` in
# tests/integration/conftest.py, which every test that changes its weights restores): they run together
# in one process, so one engine start (35-200 s) serves them all instead of one start per file.
# Each part's wall time goes to $(TIMES), and the table of them (with the total) is printed at the end, so a
# slow file shows up before it costs CI its 90-minute limit (the budget is 35 minutes on a quiet machine).
TIMES ?= .test-times.tsv
ENGINE_FILES = $(shell grep -lw sglang_engine tests/integration/test_*.py)
test: setup
	@$(MAKE) --no-print-directory lint
	@: > $(TIMES)
	@# tests/gpu is collected too: without CUDA every test there is listed as skipped, with its reason.
	@set -e; t0=$$(date +%s); \
	  $(PY) -m pytest tests/unit tests/dist tests/gpu $(PYTEST_ARGS); \
	  echo -e "$$(( $$(date +%s) - t0 ))\ttests/unit tests/dist tests/gpu" >> $(TIMES)
	@set -e; files="$(ENGINE_FILES)"; echo "== $$files (one SGLang engine)"; t0=$$(date +%s); \
	  $(PY) -m pytest $$files -m "not gpu" $(PYTEST_ARGS); \
	  echo -e "$$(( $$(date +%s) - t0 ))\t$$files" >> $(TIMES)
	@set -e; for f in $(filter-out $(ENGINE_FILES),$(wildcard tests/integration/test_*.py)); do \
	  echo "== $$f"; t0=$$(date +%s); $(PY) -m pytest "$$f" -m "not gpu" $(PYTEST_ARGS); \
	  echo -e "$$(( $$(date +%s) - t0 ))\t$$f" >> $(TIMES); done
	@$(PY) tools/test_times.py $(TIMES)

# The GPU tier needs no install step: a GPU node is often offline, so it runs with the venv when one
# exists, else with GPU_PYTHON, a python3 that already holds CUDA torch and the wheels it lacks.
GPU_PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
test-gpu:
	$(GPU_PYTHON) -m pytest tests/gpu -m gpu -p no:cacheprovider $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check megagrpo launch tools tests
	$(PY) -m ruff format --check megagrpo launch tools tests

fmt: setup
	$(PY) -m ruff check --fix megagrpo launch tools tests
	$(PY) -m ruff format megagrpo launch tools tests

lock:
	$(PYTHON312) -m pip install -q "$(UV_PIN)"
	$(PYTHON312) -m uv pip compile requirements/cpu.in --python-version 3.12 \
	  --python-platform x86_64-manylinux_2_28 -o /tmp/megagrpo-lock.txt
	( echo "# Generated by 'make lock' from requirements/cpu.in with uv; do not edit by hand."; \
	  echo "# Installed with --no-deps so every fresh install is identical. sglang is added last, without its CUDA-only deps."; \
	  grep -E '^[a-zA-Z]' /tmp/megagrpo-lock.txt; echo "sglang==0.5.23" ) > $(LOCK)

clean-venv:
	rm -rf $(VENV) .venv
