# The two commands of the README: `make chat` and `make test`. Both set everything up first.
.PHONY: setup chat test test-fast bench soak

setup:
	@bash scripts/setup.sh

chat: setup
	.venv/bin/mlxchat

# pytest's exit 5 ("no tests collected") must fail, not pass silently.
test: setup
	@.venv/bin/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The edit-test loop: every test that loads no model (tests/conftest.py marks the others "model").
test-fast: setup
	@.venv/bin/python -m pytest -q -m "not model"

bench: setup
	.venv/bin/mlxchat bench

# The chat soak (a 20-turn conversation), then the server's: 32 clients with faults for 2 minutes.
soak: setup
	.venv/bin/python scripts/soak.py
	.venv/bin/python scripts/soak.py server
