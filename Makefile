# Two commands do all the set-up on a fresh machine:
#   make run    the daemon with config/jobd.example.yaml, on $JOBD_DATABASE_URL or a local
#               cluster under .jobd/ created from the installed PostgreSQL binaries
#   make test   the whole test suite (database rules in tests/conftest.py)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# One stamp per install: `make run` needs only jobd itself, the tests and lint need the
# test extras too. A test install satisfies run (it includes the package).
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
CONFIG ?= config/jobd.example.yaml

.PHONY: run test lint bench clean-db

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
	@url="$${JOBD_DATABASE_URL:-$$($(BIN)/python -m jobd.localpg start .jobd/pg)}" || exit 1; \
	echo "jobd: database $$url"; \
	JOBD_DATABASE_URL="$$url" $(BIN)/jobd migrate -c $(CONFIG) && \
	JOBD_DATABASE_URL="$$url" exec $(BIN)/jobd run -c $(CONFIG)

test: $(TEST_STAMP)
	$(BIN)/pytest

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

# jobd next to Procrastinate, PgQueuer, Graphile Worker and pg-boss, the SQL ceiling, and
# growth (~15 min; installs the peers under $$JOBD_BENCH_HOME, default ~/.cache/jobd-bench).
# bench/queue_ops.py and bench/daemon_bench.py measure the queue functions and the daemon alone.
bench: $(TEST_STAMP)
	$(BIN)/python -m bench

clean-db:
	-$(BIN)/python -m jobd.localpg stop .jobd/pg
	rm -rf .jobd
