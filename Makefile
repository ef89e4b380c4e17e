# The two commands of the README.
.PHONY: setup demo test lint
setup:
	bash scripts/setup.sh
# --torch-compile: the step-time chart gets torch.compile too. Its cold Inductor compile
# (20-45 s) is part of the demo's ~80 s after set-up on a 2-core CPU (under 5 minutes).
demo: setup
	.venv/bin/autopar demo --torch-compile
test: setup
	.venv/bin/python -m pytest
lint:
	.venv/bin/ruff check src tests benchmarks
