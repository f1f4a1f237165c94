# The two set-up commands of the README. Each installs what it needs first (.venv/).
OUT ?= runs/tiny_grpo

.PHONY: demo test lint install clean
install:
	@bash scripts/install.sh

demo: install
	.venv/bin/elasticrl run examples/tiny_grpo.yaml --output $(OUT)

test: install
	.venv/bin/python -m tests.prepare
	.venv/bin/python -m pytest -q --durations=12

lint: install
	.venv/bin/ruff check .

clean:
	rm -rf .venv runs
