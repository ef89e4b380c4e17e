"""``autopar store``: inspect and repair the profile store.

Examples::

    autopar store show                          # this machine's store in the user's cache
    autopar store show --store ~/.cache/autopar/profiles --sort contention --limit 50
    autopar store verify --target convolution   # re-time entries, flag those > 1.5x off
    autopar store verify --fix                  # ... and replace them (clean re-measurements)
    autopar store prune --provisional           # drop entries measured under contention
    autopar store prune --signature 354c4ce7ef420df1 --dry-run

``show`` only reads: it lists every store file of a directory with its key (machine, cores,
torch, OpenMP), marks the one this process would use, and prints its entries with their
measurement quality. ``verify`` and ``prune`` work on this process's store; a file of another
key is refused (it would be moved aside as foreign). Entries that are dropped or replaced are
measured afresh by the next profile that meets them. Exit status: 0; 1 when ``verify`` found
entries off that it did not fix; 2 for a usage mistake.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from autopar.profiling.heal import HEAL_RATIO, verify_store
from autopar.profiling.quality import is_provisional, quality
from autopar.profiling.store import (
    ENV_DIR,
    ProfileStore,
    default_dir,
    default_file_name,
    read_store_file,
    store_key,
)
from autopar.tools.args import positive_int, store_path

SORT_KEYS = ("time", "target", "quality", "contention")


def add_arguments(subparsers) -> argparse.ArgumentParser:
    """Add ``store`` (with ``show``, ``verify``, ``prune``) to the ``autopar`` subcommands;
    each sets ``func=main`` and ``parser``. Returns the ``store`` parser.

    Example::

        >>> p = argparse.ArgumentParser()
        >>> _ = add_arguments(p.add_subparsers(dest="command"))
        >>> p.parse_args(["store", "prune", "--provisional"]).provisional
        True
    """
    p = subparsers.add_parser(
        "store", help="inspect and repair the profile store (show, verify, prune)"
    )
    p.description = (
        "Inspect and repair the profile store: show its entries and their measurement "
        "quality, re-time them (verify), drop the untrustworthy ones (prune)."
    )
    sub = p.add_subparsers(
        dest="store_command",
        required=True,
        metavar="ACTION",
        help="show: list entries and their quality; verify: re-time entries; prune: drop some",
    )

    show = sub.add_parser("show", help="list store files and the entries of this machine's")
    show.add_argument("--target", default=None, help="only operators whose name contains this")
    show.add_argument(
        "--sort", choices=SORT_KEYS, default="time", help="order of the entries (default time)"
    )
    show.add_argument(
        "--limit", type=positive_int, default=30, help="entries to print (default 30)"
    )
    show.add_argument("--json", action="store_true", help="print the entries as JSON")

    verify = sub.add_parser("verify", help="re-time entries; flag those more than 1.5x off")
    verify.add_argument("--target", default=None, help="only operators whose name contains this")
    verify.add_argument(
        "--limit", type=positive_int, default=None, help="re-time at most this many entries"
    )
    verify.add_argument(
        "--ratio",
        type=float,
        default=HEAL_RATIO,
        help=f"flag an entry whose old and new times differ more than this (default {HEAL_RATIO})",
    )
    verify.add_argument(
        "--fix",
        action="store_true",
        help="replace flagged entries by their re-measurement (when it is clean, or faster)",
    )

    prune = sub.add_parser("prune", help="drop entries (provisional, by target or signature)")
    prune.add_argument(
        "--provisional", action="store_true", help="drop entries measured under contention"
    )
    prune.add_argument(
        "--unverifiable",
        action="store_true",
        help="drop entries without a call description (they cannot be re-timed)",
    )
    prune.add_argument("--target", default=None, help="drop operators whose name contains this")
    prune.add_argument(
        "--signature", action="append", default=[], metavar="SIG", help="drop this entry (repeat)"
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")

    for q in (show, verify, prune):
        q.add_argument(
            "--store",
            type=store_path,
            default=None,
            help=f"a .json store or a directory (default ${ENV_DIR}, else "
            "$XDG_CACHE_HOME/autopar/profiles, else ~/.cache/autopar/profiles)",
        )
        q.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="on an error, print the full traceback",
        )
        q.set_defaults(func=main, parser=q)
    p.set_defaults(func=main, parser=p)
    return p


def main(args) -> int:
    """Run ``autopar store ACTION`` as parsed by ``add_arguments``; the exit status."""
    action = {"show": _show, "verify": _verify, "prune": _prune}[args.store_command]
    return action(args)


# -- helpers ---------------------------------------------------------------------------------
def _location(args) -> str:
    return args.store or default_dir()


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{float(seconds) * 1e3:.4f}"


def _key_text(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    cores = f"{m.get('usable_cores', m.get('logical_cores', '?'))}/{m.get('logical_cores', '?')}"
    gpus = ", ".join(m.get("cuda") or []) or "no GPU"
    return (
        f"{m.get('cpu', '?')}, {cores} cores, {gpus}, {m.get('platform', '?')}; "
        f"torch {doc.get('torch', '?')}; OpenMP {doc.get('openmp', '?')}"
    )


def _is_ours(doc: dict[str, Any]) -> bool:
    key = store_key()
    return doc.get("version") == 2 and all(doc.get(k) == v for k, v in key.items())


def _ours_or_error(args) -> ProfileStore | None:
    """This process's store at ``--store``; None (after saying why) for another key's file."""
    where = _location(args)
    if where.endswith(".json") and os.path.exists(where):
        try:
            doc = read_store_file(where)
        except (OSError, ValueError) as e:
            print(f"autopar store: {e}", file=sys.stderr)
            return None
        if not _is_ours(doc):
            print(
                f"autopar store: {where} belongs to another store key ({_key_text(doc)}); "
                "run this on that machine, or use 'autopar store show' to read it",
                file=sys.stderr,
            )
            return None
    return ProfileStore(where)


def _select(items, target: str | None):
    return [(s, r) for s, r in items if target is None or target in str(r.get("target", ""))]


# -- the actions -----------------------------------------------------------------------------
def _show(args) -> int:
    where = _location(args)
    single = where.endswith(".json")
    mine = where if single else os.path.join(where, default_file_name())
    if single:
        files = [where] if os.path.exists(where) else []
    else:
        try:
            files = [
                os.path.join(where, n) for n in sorted(os.listdir(where))
                if n.endswith(".json") and not n.endswith(".decisions.json")  # verdicts
            ]
        except OSError:
            files = []
    if not files:
        print(f"no profile store at {where} (this process's would be {mine})")
        return 0
    docs: dict[str, dict[str, Any]] = {}
    for path in files:
        try:
            docs[path] = read_store_file(path)
        except (OSError, ValueError) as e:
            print(f"{path}: not readable as a store ({e})")
            continue
        tag = " (this process's key)" if _is_ours(docs[path]) else ""
        print(f"{path}{tag}: {len(docs[path]['ops'])} entries\n  {_key_text(docs[path])}")
    doc = docs.get(mine)
    if doc is None:
        print(f"\nthis process's store {mine} does not exist yet")
        return 0
    items = _select(sorted(doc["ops"].items()), args.target)
    order = {
        "time": lambda it: -float(it[1].get("time_s", 0.0)),
        "target": lambda it: str(it[1].get("target", "")),
        "quality": lambda it: (quality(it[1]), -float(it[1].get("time_s", 0.0))),
        "contention": lambda it: -float(it[1].get("contention", 0.0)),
    }[args.sort]
    items.sort(key=order)
    if args.json:
        print(json.dumps(dict(items[: args.limit]), indent=1))
        return 0
    n_prov = sum(is_provisional(r) for _, r in items)
    n_call = sum("call" in r for _, r in items)
    print(
        f"\n{len(items)} entries ({n_prov} provisional, {len(items) - n_call} without a call "
        f"description); the first {min(args.limit, len(items))} by {args.sort}:"
    )
    head = f"  {'signature':<16} {'target':<36} {'ms':>9} {'min ms':>9} {'ms@1t':>9}"
    print(head + f" {'spread':>6} {'kept':>6} {'thr':>3} {'cont':>5}  quality")
    for sig, r in items[: args.limit]:
        kept = f"{r.get('kept', '?')}/{r.get('samples', '?')}"
        line = (
            f"  {sig:<16} {str(r.get('target', '?'))[:36]:<36} {_ms(r.get('time_s')):>9} "
            f"{_ms(r.get('min_s')):>9} {_ms(r.get('time_1t_s')):>9} "
            f"{r.get('spread', '-'):>6} {kept:>6} {r.get('threads', '-'):>3} "
            f"{r.get('contention', '-'):>5}  {quality(r)}"
        )
        print(line + (f" ({r['reason']})" if r.get("reason") else ""))
    return 0


def _verify(args) -> int:
    store = _ours_or_error(args)
    if store is None:
        return 2
    sigs = [s for s, _ in _select(store.items(), args.target)][: args.limit]
    print(f"re-timing {len(sigs)} entries of {store.path} (ratio {args.ratio})", flush=True)
    verdicts = verify_store(store, sigs, ratio=args.ratio, fix=args.fix)
    for v in verdicts:
        ratio = f"{v.new_s / v.stored_s:.3g}x" if v.new_s and v.stored_s > 0 else "-"
        print(
            f"  {v.status:<7} {v.signature:<16} {v.target[:36]:<36} stored {_ms(v.stored_s):>9} "
            f"now {_ms(v.new_s):>9} {ratio:>8}" + (f"  {v.note}" if v.note else "")
        )
    statuses = ("ok", "off", "fixed", "unsure", "skipped")
    counts = {s: sum(v.status == s for v in verdicts) for s in statuses}
    print("  " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if counts["off"]:
        print("  entries 'off' were kept; rerun with --fix to replace them, or prune them")
    if counts["unsure"]:
        print("  'unsure': the re-measurement was contended; verify again when the machine is idle")
    return 1 if counts["off"] else 0


def _prune(args) -> int:
    if not (args.provisional or args.unverifiable or args.target or args.signature):
        print(
            "autopar store prune: say what to drop: --provisional, --unverifiable, "
            "--target SUBSTR or --signature SIG",
            file=sys.stderr,
        )
        return 2
    store = _ours_or_error(args)
    if store is None:
        return 2
    wanted = set(args.signature)
    drop = [
        (sig, r)
        for sig, r in store.items()
        if (args.provisional and is_provisional(r))
        or (args.unverifiable and "call" not in r)
        or (args.target is not None and args.target in str(r.get("target", "")))
        or sig in wanted
    ]
    for sig, r in drop:
        print(f"  {'would drop' if args.dry_run else 'dropped'} {sig} {r.get('target', '?')}")
    missing = wanted - {sig for sig, _ in drop}
    for sig in sorted(missing):
        print(f"  no entry {sig}")
    if not args.dry_run and drop:
        for sig, _ in drop:
            store.remove(sig)
        store.flush()
    verb = "would drop" if args.dry_run else "dropped"
    print(f"{verb} {len(drop)} of {len(store) + (0 if args.dry_run else len(drop))} entries")
    return 0
