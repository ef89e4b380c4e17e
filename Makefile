# The two commands of the README.
.PHONY: setup demo test lint
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/autopar demo
test: setup
	.venv/bin/python -m pytest
lint:
	.venv/bin/ruff check src tests benchmarks
