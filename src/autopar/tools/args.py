"""argparse types shared by the command line, the benchmarks and the demo."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a positive integer, with a message that says what was wrong."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v
