# One command to run, one to test. Both create .venv and install on first use, with the exact
# versions requirements.lock pins (the ones the tests ran with); plain pip, nothing else.
PYTHON ?= python3
VENV ?= .venv
LOCK := requirements.lock
STAMP := $(VENV)/.installed-stamp
# What `make lock` passes to pip-compile besides the fixed options, e.g.
# PIP_COMPILE_ARGS=--upgrade, or PIP_COMPILE_ARGS="--upgrade-package fastmcp".
PIP_COMPILE_ARGS ?=

.PHONY: up test test-fast lint typecheck lock clean browser

# Reinstalled when the lock or pyproject.toml changes. `pip check` fails when pyproject.toml
# asks for something the lock does not pin (run `make lock`): butlers itself goes in with
# --no-deps, so nothing unpinned slips in. No build isolation: the lock's setuptools builds it.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -r $(LOCK)
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	$(VENV)/bin/pip check
	touch $(STAMP)

# UP_ARGS: flags for `butlers up`, e.g. UP_ARGS="--port-offset 50" beside a running fleet.
UP_ARGS ?=
up: $(STAMP)
	$(VENV)/bin/butlers up $(UP_ARGS)

# The tests keep bytecode, outside the source tree (in the venv, rebuilt with it). Where
# PYTHONDONTWRITEBYTECODE is set (the CI machine sets it), each pytest worker rewrote every test
# module's asserts and each of the many processes the tests start compiled butlers/ again:
# collecting the fast loop took 4.4 s CPU per worker, 2.2 s with the cache (measured).
PYTEST := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache $(VENV)/bin/pytest

# The whole suite, one xdist worker per core, a test module to a worker (its module fixtures
# start once; its tests run in their order). Most tests wait on processes they start: on 2
# cores the suite took 17:32 one test at a time and 9:25 with two workers (measured).
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test: $(STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile

# The fast lane: the tests that start no process and need neither PostgreSQL, Claude Code nor
# npm's servers (markers `pg`, `claude`, `npm`, `proc`, set in tests/conftest.py from the
# fixtures a test uses or its name; a test left unmarked that starts a process fails, saying
# to mark it). The loop to run while editing, spread over one pytest-xdist worker per core, by
# xdist group (tests sharing a server stay on one worker). Measured on 2 cores with the
# machine busy (load 4-5): 505 tests, 15-22 s; the lane started processes before and took
# ~85 s for 639 tests. More workers do not help: each collects every test module first.
TEST_FAST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test-fast: $(STAMP)
	$(PYTEST) -m "not pg and not claude and not npm and not proc" -n $(TEST_FAST_WORKERS) \
		--dist loadgroup

# Debian's Chromium for tests/test_dashboard_browser.py (CI runs it before `make test`, where
# that test fails without a browser: CI is set). Fails, saying why, when there is none and it
# cannot install one (root with apt-get); apt-get's own output is shown then.
browser:
	@if [ -n "$$BUTLERS_TEST_CHROMIUM" ]; then \
		[ -x "$$BUTLERS_TEST_CHROMIUM" ] && exit 0; \
		echo "make browser: BUTLERS_TEST_CHROMIUM=$$BUTLERS_TEST_CHROMIUM is not an executable" >&2; exit 1; \
	fi; \
	command -v chromium >/dev/null 2>&1 && exit 0; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "make browser: no Chromium, and not root with apt-get: install Debian's chromium" \
			"or set BUTLERS_TEST_CHROMIUM to a Chromium binary" >&2; exit 1; \
	fi; \
	log=$$(mktemp) && trap 'rm -f "$$log"' EXIT; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q chromium >"$$log" 2>&1 || \
		{ apt-get update -q >"$$log" 2>&1 && apt-get install -y -q chromium >"$$log" 2>&1; } || \
		{ tail -n 20 "$$log" >&2; echo "make browser: apt-get could not install chromium" >&2; exit 1; }; \
	command -v chromium >/dev/null 2>&1 || \
		{ echo "make browser: apt-get installed chromium, yet it is not on PATH" >&2; exit 1; }

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# mypy on butlers/, configured in pyproject.toml ([tool.mypy]: what it checks and how strictly).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Re-resolve requirements.lock from pyproject.toml with pip-tools, in a throwaway venv (so it
# is not one of the project's dependencies). Without PIP_COMPILE_ARGS it keeps every pin the
# ranges still admit and only adds or drops what changed.
lock:
	@tools=$$(mktemp -d) && trap 'rm -rf "$$tools"' EXIT && \
	$(PYTHON) -m venv "$$tools" && \
	"$$tools/bin/pip" install --quiet 'pip-tools>=7.4,<8' && \
	CUSTOM_COMPILE_COMMAND="make lock" "$$tools/bin/pip-compile" --quiet --extra dev \
		--strip-extras --allow-unsafe --no-emit-index-url --no-emit-trusted-host \
		--no-emit-find-links $(PIP_COMPILE_ARGS) --output-file $(LOCK) pyproject.toml

clean:
	rm -rf $(VENV)
