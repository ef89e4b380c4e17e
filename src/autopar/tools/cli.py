"""The ``autopar`` command line: profile, plan, bench, demo.

Examples::

    autopar profile autopar.tools.zoo:inception --input-shape 8,3,16,16 --out inception.json
    autopar plan autopar.tools.zoo:towers --input-shape 32,64 --streams 2 --gantt plan.png
    autopar bench --models inception,towers --steps 20
    autopar demo --steps 60
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

EPILOG = """MODULE:FACTORY names a zero-argument callable returning an nn.Module, e.g.
autopar.tools.zoo:inception or mypkg.models:make_model (the current directory is importable)."""


def _load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(
            f"autopar: expected MODULE:FACTORY (e.g. autopar.tools.zoo:mlp), got {spec!r}"
        )
    mod_name, fn_name = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SystemExit(f"autopar: cannot import module {mod_name!r}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise SystemExit(f"autopar: {mod_name!r} has no callable {fn_name!r}")
    import torch.nn as nn

    model = fn()
    if not isinstance(model, nn.Module):
        raise SystemExit(f"autopar: {spec} returned {type(model).__name__}, not an nn.Module")
    return model


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--input-shape takes comma-separated ints like 16,32,64, got {text!r}"
        ) from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"--input-shape dims must be positive, got {text!r}")
    return dims


def _inputs(args):
    import torch

    if not args.input_shape:
        raise SystemExit("autopar: give at least one --input-shape (one per model input)")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if dtype.is_floating_point:
        return tuple(torch.randn(s, dtype=dtype) for s in args.input_shape)
    return tuple(torch.randint(0, 10, s, dtype=dtype) for s in args.input_shape)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:FACTORY", help="callable returning the nn.Module")
    p.add_argument(
        "--input-shape",
        type=_shape,
        action="append",
        metavar="D0,D1,...",
        help="shape of one example input (repeat for several inputs)",
    )
    p.add_argument("--dtype", default="float32", help="dtype of the example inputs")


def cmd_profile(args) -> int:
    from autopar.api import profile
    from autopar.profiling.profiler import profile_table_summary
    from autopar.profiling.store import ProfileStore

    store = ProfileStore(args.out)
    table = profile(_load_factory(args.model), *_inputs(args), store=store)
    print(profile_table_summary(table, top=args.top))
    store.flush()
    print(f"\nprofile store: {store.path} ({len(store)} operator signatures)")
    if args.csv:
        table.to_csv(args.csv, index=False)
        print(f"profile table: {args.csv}")
    return 0


def cmd_plan(args) -> int:
    from autopar.api import plan

    p = plan(
        _load_factory(args.model),
        *_inputs(args),
        streams=args.streams,
        policy=args.policy,
        store=args.store,
    )
    print(p.summary())
    if args.gantt:
        print(f"Gantt chart: {p.gantt(args.gantt)}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(p.to_json(indent=1))
        print(f"plan: {args.json}")
    return 0


def cmd_bench(args) -> int:
    from autopar.tools.bench import main as bench_main

    return bench_main(args)


def cmd_demo(args) -> int:
    from autopar.tools.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Operator-profiling auto-parallelization compiler for PyTorch training.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "profile",
        help="profile every forward/backward operator, print the top ones, write the store",
        epilog=EPILOG,
    )
    _add_model_args(p)
    p.add_argument(
        "--out", default=None, help="store: a .json file or a directory (default ./profiles)"
    )
    p.add_argument("--top", type=int, default=10, help="how many top operators to print")
    p.add_argument("--csv", default=None, help="also write the whole profile table as CSV")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="plan a model and print/draw the plan", epilog=EPILOG)
    _add_model_args(p)
    p.add_argument("--streams", type=int, default=None, help="streams to plan for")
    p.add_argument(
        "--policy",
        default="auto",
        choices=["auto", "serial", "round_robin", "heft", "nimble"],
        help="partitioner (auto: the one the simulator predicts fastest)",
    )
    p.add_argument("--store", default=None, help="profile store (.json file or directory)")
    p.add_argument("--gantt", default=None, help="write the Gantt chart PNG here")
    p.add_argument("--json", default=None, help="write plan.json here")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "bench", help="time the training step of eager, torch.compile and autopar; print ratios"
    )
    from autopar.tools.bench import add_arguments as bench_args

    bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="train a character-level LSTM with eager and autopar")
    from autopar.tools.demo import add_arguments as demo_args

    demo_args(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
