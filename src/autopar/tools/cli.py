"""The ``autopar`` command line: profile, plan, bench, bench-report, demo.

Examples::

    autopar profile autopar.tools.zoo:inception --input-shape 8,3,16,16 --store inception.json
    autopar plan autopar.tools.zoo:towers --input-shape 32,64 --streams 2 --gantt plan.png
    autopar plan my_model.py:make                  # make() returns (model, example_inputs)
    autopar bench --models inception,towers --steps 20
    autopar bench --model my_model.py:make         # is autopar worth it for my model?
    autopar bench-report results/bench-full/bench.json --readme README.md
    autopar demo --model towers
    autopar --version

A mistake on the command line (a bad option, a model that does not run on the given shapes)
ends with exit status 2 and two lines on stderr: what was wrong and where to look. Any other
failure ends with status 1 and two lines as well. ``--debug`` or ``AUTOPAR_DEBUG=1`` adds the
full traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from autopar.tools.args import UsageError
from autopar.tools.args import one_line as _one_line
from autopar.tools.factory import METAVAR, load_model

EPILOG = """MODULE:FACTORY or FILE.py:FACTORY (MODULE_OR_FILE:FACTORY) names a zero-argument
callable returning an nn.Module, or (model, example_inputs), e.g. autopar.tools.zoo:inception,
mypkg.models:make_model (the current directory is importable) or path/to/my_model.py:make."""

#: Former option names, still accepted but not shown in --help: {command: {old: new}}.
RENAMED = {"profile": {"--out": "--store"}}

DEBUG_ENV = "AUTOPAR_DEBUG"
DEBUG_HINT = f"rerun with --debug (or {DEBUG_ENV}=1) for the full traceback"


class _Parser(argparse.ArgumentParser):
    """argparse, with errors cut to two lines: the full usage of a subcommand wraps over
    several lines and buries the one line that says what was wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\nsee '{self.prog} --help'\n")


def _debug_requested(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _renamed(argv: list[str]) -> list[str]:
    """``argv`` with the former option names of its command (``RENAMED``) replaced by
    today's; each use warns (FutureWarning), and the options' help shows only the new name.

    Example::

        >>> _renamed(["profile", "m:f", "--out=p.json"])  # doctest: +SKIP
        ['profile', 'm:f', '--store=p.json']
    """
    command = next((a for a in argv if not a.startswith("-")), None)
    names = RENAMED.get(command or "", {})
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        old, eq, value = arg.partition("=")
        if old in names:
            warnings.warn(
                f"autopar {command}: {old} is the former name of {names[old]}; use {names[old]}",
                FutureWarning,
                stacklevel=3,
            )
            out[i] = names[old] + eq + value
    return out


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints like 16,32,64, got {text!r}"
        ) from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"dims must be positive, got {text!r}")
    return dims


def _shapes_text(args) -> str:
    return " ".join(f"--input-shape {','.join(map(str, s))}" for s in args.input_shape)


def _inputs(args) -> tuple:
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if dtype.is_floating_point:
        return tuple(torch.randn(s, dtype=dtype) for s in args.input_shape)
    return tuple(torch.randint(0, 10, s, dtype=dtype) for s in args.input_shape)


def _model_and_inputs(args):
    """The model and its example inputs, checked by one eager forward before any profiling:
    a shape or dtype that does not fit fails here in one line, not deep inside tracing."""
    import torch

    model, given = load_model(args.model)
    if args.input_shape:
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        dtype = getattr(torch, args.dtype)
        if dtype.is_floating_point and param is not None and param.dtype != dtype:
            have = str(param.dtype).removeprefix("torch.")
            raise UsageError(
                f"--dtype {args.dtype} does not match the model's {have} parameters (autopar "
                f"runs the model as its factory returns it): pass --dtype {have}, or make "
                f"{args.model} return a {args.dtype} model"
            )
        inputs = _inputs(args)
        where = f"{_shapes_text(args)} ({args.dtype})"
    elif given is not None:
        inputs, where = given, "the example inputs its factory returned"
    else:
        raise UsageError(
            "give at least one --input-shape (one per model input), e.g. 16,32, or make "
            f"{args.model} return (model, example_inputs)"
        )
    saved = [b.detach().clone() for b in model.buffers()]
    try:
        # fork_rng and the buffer restore keep the check from changing what is profiled
        # (dropout draws, BatchNorm running statistics).
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(*inputs)
    except Exception as exc:
        raise UsageError(
            f"{args.model} does not run on {where}: "
            f"{type(exc).__name__}: {_one_line(exc)}; pass the shape(s) its forward expects"
        ) from exc
    finally:
        with torch.no_grad():
            for b, old in zip(model.buffers(), saved, strict=True):
                b.copy_(old)
    return model, inputs


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from autopar.tools.args import INPUT_DTYPES, dtype_name

    p.add_argument(
        "model",
        metavar=METAVAR,
        help="callable returning the nn.Module, or (model, example_inputs)",
    )
    p.add_argument(
        "--input-shape",
        type=_shape,
        action="append",
        metavar="D0,D1,...",
        help="shape of one example input (repeat for several inputs); random inputs of these "
        "shapes replace the example inputs a factory returns",
    )
    p.add_argument(
        "--dtype",
        type=dtype_name,
        default="float32",
        help=f"dtype of the example inputs, one of {', '.join(INPUT_DTYPES)} (default float32; "
        "a floating dtype must match the model's parameters)",
    )


def _add_debug_arg(p: argparse.ArgumentParser, default) -> None:
    p.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help=f"on an error, print the full traceback (also: {DEBUG_ENV}=1)",
    )


def cmd_profile(args) -> int:
    from autopar.api import profile
    from autopar.profiling.profiler import profile_table_summary
    from autopar.profiling.store import ProfileStore

    model, inputs = _model_and_inputs(args)
    store = ProfileStore(args.store)
    table = profile(model, *inputs, store=store)
    print(profile_table_summary(table, top=args.top))
    store.flush()
    print(f"\nprofile store: {store.path} ({len(store)} operator signatures)")
    if args.csv:
        table.to_csv(args.csv, index=False)
        print(f"profile table: {args.csv}")
    return 0


def cmd_plan(args) -> int:
    from autopar.api import plan

    model, inputs = _model_and_inputs(args)
    p = plan(model, *inputs, streams=args.streams, policy=args.policy, store=args.store)
    print(p.summary())
    if args.gantt:
        print(f"Gantt chart: {p.gantt(args.gantt, title=args.model)}")
    if args.trace:
        p.to_chrome_trace(args.trace)
        print(f"timeline trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.json:
        with open(args.json, "w") as f:
            f.write(p.to_json(indent=1))
        print(f"plan: {args.json}")
    return 0


def cmd_bench(args) -> int:
    from autopar.tools.bench import main as bench_main

    if args.readme and not args.out:
        raise UsageError("--readme rewrites the README from the bench JSON: give --out too")
    status = bench_main(args)
    if args.readme:
        _rewrite_readme(args.out, args.readme)
    return status


def cmd_bench_report(args) -> int:
    from autopar.tools.bench_report import readme_table

    fm = _first_minute_doc(getattr(args, "first_minute", None))
    if not args.readme:
        print(readme_table(_bench_doc(args.json), args.json, fm))
        return 0
    changed = _rewrite_readme(args.json, args.readme, check=args.check, fm=fm)
    return 1 if args.check and changed else 0


def _bench_doc(path: str) -> dict:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"no bench JSON at {path} (write one with autopar bench --out)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or "meta" not in doc or "results" not in doc:
        raise UsageError(f"{path} is not an autopar bench JSON (no 'meta' and 'results')")
    return doc


def _first_minute_doc(path: str | None) -> list | None:
    """The ``first_minute`` results of a ``bench --first-minute --out`` JSON, or None."""
    if path is None:
        return None
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["first_minute"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path} is no `autopar bench --first-minute` JSON ({exc})") from None


def _rewrite_readme(json_path: str, readme: str, check: bool = False, fm=None) -> bool:
    """The README's generated results section from the bench JSON; says what it did."""
    from autopar.tools.bench_report import update_readme

    try:
        changed = update_readme(readme, _bench_doc(json_path), json_path, check=check, fm=fm)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    verb = ("is out of date" if changed else "is up to date") if check else (
        "rewritten" if changed else "already up to date")  # fmt: skip
    print(f"{readme}: results section {verb} (from {json_path})")
    return changed


def cmd_demo(args) -> int:
    from autopar.tools.demo import main as demo_main

    return demo_main(args)


def _version() -> str:
    import platform

    import torch

    import autopar

    python = platform.python_version()
    return f"autopar {autopar.__version__} (torch {torch.__version__}, Python {python})"


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser (subcommands profile, plan, bench, bench-report, demo,
    store).

    Example::

        >>> build_parser().parse_args(["plan", "m:f", "--input-shape", "4,8"]).streams is None
        True
    """
    from autopar.planning.policies import SINGLE_DEVICE_POLICY_NAMES
    from autopar.tools.args import add_store_argument, image_file, output_file, positive_int

    parser = _Parser(
        prog="autopar",
        description="Operator-profiling auto-parallelization compiler for PyTorch training.",
        epilog=EPILOG,
    )
    parser.add_argument(
        "--version", action="version", version=_version(), help="print the versions and exit"
    )
    _add_debug_arg(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "profile",
        help="profile every forward/backward operator, print the top ones, write the store",
        epilog=EPILOG,
    )
    _add_model_args(p)
    add_store_argument(p)  # formerly --out, still accepted (RENAMED)
    p.add_argument("--top", type=positive_int, default=10, help="how many top operators to print")
    p.add_argument(
        "--csv", type=output_file, default=None, help="also write the whole profile table as CSV"
    )
    p.set_defaults(func=cmd_profile, parser=p)

    p = sub.add_parser("plan", help="plan a model and print/draw the plan", epilog=EPILOG)
    _add_model_args(p)
    p.add_argument("--streams", type=positive_int, default=None, help="streams to plan for")
    p.add_argument(
        "--policy",
        default="auto",
        choices=SINGLE_DEVICE_POLICY_NAMES,
        help="partitioner (auto: the one the simulator predicts fastest)",
    )
    add_store_argument(p)
    p.add_argument(
        "--gantt", type=image_file, default=None, help="write the Gantt chart (.png/.svg/.pdf) here"
    )
    p.add_argument(
        "--trace",
        type=output_file,
        default=None,
        help="write the predicted timeline as a Chrome trace (JSON, opens in Perfetto) here",
    )
    p.add_argument("--json", type=output_file, default=None, help="write plan.json here")
    p.set_defaults(func=cmd_plan, parser=p)

    p = sub.add_parser(
        "bench", help="time the training step of eager, torch.compile and autopar; print ratios"
    )
    from autopar.tools.bench import add_arguments as bench_args

    bench_args(p)
    p.add_argument(
        "--readme", default=None, metavar="README.md",
        help="after the run, rewrite this file's results section (between the autopar "
        "bench-report marker comments) from the --out JSON",
    )  # fmt: skip
    p.set_defaults(func=cmd_bench, parser=p)

    p = sub.add_parser(
        "bench-report",
        help="print the README results table of a bench JSON, or rewrite README.md's section",
    )  # fmt: skip
    p.add_argument("json", metavar="BENCH.json", help="what `autopar bench --out` wrote")
    p.add_argument(
        "--readme", default=None, metavar="README.md",
        help="rewrite this file's section between the autopar bench-report marker comments",
    )  # fmt: skip
    p.add_argument(
        "--check", action="store_true",
        help="with --readme: change nothing; exit 1 if the section is out of date",
    )  # fmt: skip
    p.add_argument(
        "--first-minute", default=None, metavar="FM.json",
        help="add the first-minute columns from what `autopar bench --first-minute --out` wrote",
    )  # fmt: skip
    p.set_defaults(func=cmd_bench_report, parser=p)

    p = sub.add_parser(
        "demo", help="train charlstm, towers or bert with eager and autopar; show the decisions"
    )
    from autopar.tools.demo import add_arguments as demo_args

    demo_args(p)
    p.set_defaults(func=cmd_demo, parser=p)
    from autopar.tools.store_cmd import add_arguments as store_args

    store_args(sub)  # autopar store show|verify|prune
    for p in sub.choices.values():
        # SUPPRESS: a subcommand's default must not undo `autopar --debug COMMAND`.
        _add_debug_arg(p, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 usage error).

    Example::

        >>> main(["plan", "autopar.tools.zoo:mlp", "--input-shape", "16,32"])  # doctest: +SKIP
        0
    """
    args = build_parser().parse_args(_renamed(sys.argv[1:] if argv is None else argv))
    parser: argparse.ArgumentParser = args.parser
    debug = _debug_requested(args)
    try:
        return args.func(args)
    except UsageError as exc:
        if debug:
            traceback.print_exc()
        parser.error(str(exc))  # exits with status 2
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return _report(parser.prog, exc, debug)
    return 0  # unreachable: parser.error exits


def _report(prog: str, exc: Exception, debug: bool) -> int:
    """Two lines for an error that escaped a command: autopar's own errors (a model it
    cannot capture, a plan that cannot meet the constraints) are the user's to fix (2);
    anything else is a failure (1) whose traceback a bug report needs."""
    from autopar.errors import AutoparError

    if debug:
        traceback.print_exc()
    if isinstance(exc, AutoparError):
        what, status = f"error: {_one_line(exc)}", 2
    elif isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        what, status = f"error: {exc.strerror or _one_line(exc)}{where}", 1
    else:
        what, status = f"failed: {type(exc).__name__}: {_one_line(exc)}", 1
    print(f"{prog}: {what}", file=sys.stderr)
    print(f"{prog}: {'see the traceback above' if debug else DEBUG_HINT}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
