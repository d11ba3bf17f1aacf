# Two commands do all the set-up on a fresh machine:
#   make run    the daemon with config/jobd.example.yaml, on $JOBD_DATABASE_URL or a local
#               cluster under .jobd/ created from the installed PostgreSQL binaries, on port
#               54329 (make run JOBD_PG_PORT=N where that port is taken)
#   make test   the whole test suite (database rules in tests/conftest.py)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# One stamp per install: `make run` needs only jobd itself, the tests and lint need the
# test extras too. A test install satisfies run (it includes the package).
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
CONFIG ?= config/jobd.example.yaml
JOBD_PG_PORT ?= 54329

# Debian packages that some tests use, as package:command. Tests skip, naming the package,
# where one is missing.
TEST_DEBS := prometheus:promtool pgbouncer:pgbouncer faketime:faketime tmux:tmux

.PHONY: run test test-packages lint bench clean-db

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(TEST_STAMP) $(RUN_STAMP)

run: $(RUN_STAMP)
	@url="$${JOBD_DATABASE_URL:-$$($(BIN)/python -m jobd.localpg start .jobd/pg --port $(JOBD_PG_PORT))}" || exit 1; \
	echo "jobd: database $$url"; \
	JOBD_DATABASE_URL="$$url" $(BIN)/jobd migrate -c $(CONFIG) && \
	JOBD_DATABASE_URL="$$url" exec $(BIN)/jobd run -c $(CONFIG)

test: $(TEST_STAMP) test-packages
	$(BIN)/pytest

# Best effort, never a failure: installs the missing packages with apt-get when it can run
# it (as root or with passwordless sudo), else names them.
test-packages:
	@missing=""; for entry in $(TEST_DEBS); do \
	  command -v "$${entry#*:}" >/dev/null 2>&1 || [ -x "/usr/sbin/$${entry#*:}" ] \
	    || missing="$$missing $${entry%%:*}"; \
	done; \
	[ -n "$$missing" ] || exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else sudo="-"; fi; \
	if [ "$$sudo" = "-" ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make: missing Debian packages (their tests skip):$$missing"; exit 0; fi; \
	echo "make: installing Debian packages for the tests:$$missing"; \
	{ $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $$sudo apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } \
	  || echo "make: could not install:$$missing (their tests skip)"

LINT_STAMP := $(VENV)/.installed-lint

$(LINT_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,lint]'
	touch $(LINT_STAMP) $(TEST_STAMP) $(RUN_STAMP)

lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# jobd next to Procrastinate, PgQueuer, Graphile Worker and pg-boss, the SQL ceiling, and
# growth (~15 min; installs the peers under $$JOBD_BENCH_HOME, default ~/.cache/jobd-bench).
# bench/queue_ops.py and bench/daemon_bench.py measure the queue functions and the daemon alone.
bench: $(TEST_STAMP)
	$(BIN)/python -m bench

clean-db:
	-$(BIN)/python -m jobd.localpg stop .jobd/pg
	rm -rf .jobd
