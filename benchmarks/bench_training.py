"""Training-step benchmark: eager vs torch.compile vs autopar, interleaved in one process.

The same code as ``autopar bench`` (``autopar.tools.bench``); see benchmarks/README.md. Run::

    .venv/bin/python benchmarks/bench_training.py                     # all models, ~15 min
    .venv/bin/python benchmarks/bench_training.py --quick             # smoke run, ~1 min
    .venv/bin/python benchmarks/bench_training.py --models towers --no-inductor

All models includes the tiny random HF BERT and GPT-2 when ``transformers`` is installed
(``pip install 'autopar[bench]'``). Start on a quiet machine: on 2 cores one busy neighbour
makes 2-thread ops 10-50x slower (see docs/benchmarks.md).
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
