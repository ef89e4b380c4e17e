"""argparse types shared by the command line, the benchmarks and the demo.

Each one checks a value when it is parsed, before any work starts, and says what was wrong and
how to fix it (argparse prefixes the option: ``argument --top: expected a positive ...``).

Example::

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--dtype", type=dtype_name, default="float32")
    >>> p.parse_args(["--dtype", "torch.half"]).dtype
    'float16'
"""

from __future__ import annotations

import argparse
import difflib
import os


class UsageError(Exception):
    """A mistake in what the user asked for, found after parsing: reported like argparse's
    own errors (exit status 2), without a traceback.

    Example::

        >>> raise UsageError("give at least one --input-shape")   # doctest: +SKIP
    """


def one_line(text: object) -> str:
    """The first non-blank line of ``text``, stripped: what an error message quotes of an
    exception whose text runs over several lines.

    Example::

        >>> one_line(ValueError("shape mismatch" + chr(10) + "  at line 3"))
        'shape mismatch'
    """
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


#: The dtypes the command line can make example inputs of (random floats, or ints in 0..9).
INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")

# PyTorch's own aliases (torch.float is torch.float32, ...), so the usual spellings work.
_DTYPE_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
}

#: File name extensions ``--gantt`` can write (matplotlib picks the format by extension).
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def positive_int(text: str) -> int:
    """argparse type: a positive integer, with a message that says what was wrong.

    Example::

        >>> positive_int("3")
        3
    """
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1 or more), got {v}")
    return v


def dtype_name(text: str) -> str:
    """argparse type: the canonical name of an input dtype (``torch.`` prefix and PyTorch's
    aliases accepted); a typo gets the closest valid name.

    Example::

        >>> dtype_name("double")
        'float64'
    """
    name = text.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name in INPUT_DTYPES:
        return name
    close = difflib.get_close_matches(name, INPUT_DTYPES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown dtype {text!r}; {hint}choose one of {', '.join(INPUT_DTYPES)}"
    )


def _check_parent(text: str) -> None:
    parent = os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"the directory of {text!r} does not exist; create it first "
            f"(mkdir -p {parent}) or choose another path"
        )
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent!r} is not writable")


def output_file(text: str) -> str:
    """argparse type: a file the command will write. Checked up front, so a typo in the
    directory fails before minutes of profiling rather than after.

    Example::

        >>> output_file("plan.json")
        'plan.json'
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; give a file name inside it, e.g. {os.path.join(text, 'out')}"
        )
    _check_parent(text)
    return text


def image_file(text: str) -> str:
    """argparse type: like ``output_file``, and the extension names an image format.

    Example::

        >>> image_file("plan.svg")
        'plan.svg'
    """
    ext = os.path.splitext(text)[1].lower()
    if ext not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{text!r} needs an image extension, one of {', '.join(IMAGE_SUFFIXES)} (e.g. plan.png)"
        )
    return output_file(text)


#: Where the profile store is when ``--store`` is not given (``profiling.store.default_dir``).
STORE_DEFAULT = (
    "$AUTOPAR_PROFILE_DIR, else $XDG_CACHE_HOME/autopar/profiles, else ~/.cache/autopar/profiles"
)


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    """``--store``: the profile store, with one name, check and help text in every command
    (profile, plan, bench, demo, store).

    Example::

        >>> p = argparse.ArgumentParser()
        >>> add_store_argument(p)
        >>> p.parse_args(["--store", "mine.json"]).store, p.parse_args([]).store
        ('mine.json', None)
    """
    parser.add_argument(
        "--store",
        type=store_path,
        default=None,
        metavar="PATH",
        help=f"the profile store: a .json file or a directory (default {STORE_DEFAULT})",
    )


def store_path(text: str) -> str:
    """argparse type: a profile store location, a ``.json`` file or a directory. Missing
    directories are created when the store is written; only a file standing where a directory
    must be (or a directory named ``*.json``) is an error.

    Example::

        >>> store_path("profiles")
        'profiles'
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a .json file or a directory, got ''")
    if text.endswith(".json"):
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a directory; a store path ending in .json must be a file"
            )
        directory = os.path.dirname(text)
    else:
        if os.path.exists(text) and not os.path.isdir(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a file but not a .json store; give a directory or a .json file"
            )
        directory = text
    # The store makes missing directories; that fails if a path component is a file.
    probe = os.path.abspath(directory or ".")
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(
            f"cannot create the store {text!r}: {probe!r} is a file, not a directory"
        )
    return text
