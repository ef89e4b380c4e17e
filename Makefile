# The two commands of the README (make demo, make test), and the linter CI runs.
# Each set-up leaves a stamp in .venv, so a second command (CI runs make lint, then make test)
# does not install again; a changed pyproject.toml or set-up script does.
.PHONY: setup setup-dev demo test lint
setup: .venv/.setup
setup-dev: .venv/.setup-dev
# what autopar and its demo import; no test tools (the dev extras bring triton, about 1 GB)
.venv/.setup: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@
# the test suite's and the linter's tools too
.venv/.setup-dev: pyproject.toml scripts/setup.sh
	AUTOPAR_EXTRAS=dev bash scripts/setup.sh
	touch $@ .venv/.setup
# --torch-compile: the step-time chart gets torch.compile too. Its cold Inductor compile
# (20-45 s) is part of the demo's ~80 s after set-up on a 2-core CPU (under 5 minutes).
demo: setup
	.venv/bin/autopar demo --torch-compile
test: setup-dev
	.venv/bin/python -m pytest
lint: setup-dev
	.venv/bin/ruff check --no-cache src tests benchmarks
