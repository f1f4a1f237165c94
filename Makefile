# The two set-up commands of the README. Each installs what it needs first (.venv/).
OUT ?= runs/tiny_grpo

.PHONY: demo test lint docs install clean
install:
	@bash scripts/install.sh

demo: install
	.venv/bin/elasticrl run examples/tiny_grpo.yaml --output $(OUT)

# Two workers, each with its own Ray (tests/conftest.py says how the tests are grouped); 0: one process.
TEST_WORKERS ?= 2
test: install
	.venv/bin/python -m tests.prepare
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --durations=12

lint: install
	.venv/bin/ruff check .

# The documentation site, built strictly (a broken link or anchor fails) into site/.
docs: install
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

clean:
	rm -rf .venv runs site
