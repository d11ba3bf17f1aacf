# Two commands do all the set-up on a fresh machine:
#   make run    the daemon with config/jobd.example.yaml, on $JOBD_DATABASE_URL or a local
#               cluster under .jobd/ created from the installed PostgreSQL binaries
#   make test   the whole test suite (database rules in tests/conftest.py)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= config/jobd.example.yaml

.PHONY: run test lint bench clean-db

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	@url="$${JOBD_DATABASE_URL:-$$($(BIN)/python -m jobd.localpg start .jobd/pg)}" || exit 1; \
	echo "jobd: database $$url"; \
	JOBD_DATABASE_URL="$$url" $(BIN)/jobd migrate -c $(CONFIG) && \
	JOBD_DATABASE_URL="$$url" exec $(BIN)/jobd run -c $(CONFIG)

test: $(STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/queue_ops.py

clean-db:
	-$(BIN)/python -m jobd.localpg stop .jobd/pg
	rm -rf .jobd
