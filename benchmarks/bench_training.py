"""Training-step benchmark: eager vs torch.compile vs autopar, interleaved in one process.

The same code as ``autopar bench`` (``autopar.tools.bench``); see benchmarks/README.md. Run::

    .venv/bin/python benchmarks/bench_training.py                     # all models, ~minutes
    .venv/bin/python benchmarks/bench_training.py --models towers --no-inductor
"""

from __future__ import annotations

import argparse
import sys

from autopar.tools.bench import add_arguments, main


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_training.py")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(run())
