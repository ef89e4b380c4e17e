"""Single-process multi-GPU pipeline: stages on ``cuda:0..n``, copies on side streams.

``multi_device_source`` generates the program (readable Python; what prints is what runs)
and ``compile_multi_device`` executes it. Split from ``autopar.parallel.distributed``; tested
structurally on the CPU, run on a lent GPU machine only.
"""

from __future__ import annotations

import torch


def multi_device_source(n_stages: int, microbatches: int) -> str:
    """Python source of a one-process pipeline: stage ``j`` on ``devices[j]``, micro-batches
    in a fill-drain wavefront, each activation copied to the next device on a side stream
    (``non_blocking``), the consumer's stream waiting on the copy's event. CUDA launches
    are asynchronous, so stage ``j`` of micro-batch ``m`` runs while stage ``j-1`` runs
    micro-batch ``m+1``. With ``streams[j] is None`` (CPU) the same code runs serially.

    Example::

        >>> "non_blocking=True" in multi_device_source(2, 4)
        True
    """
    s, m = n_stages, microbatches
    L = [
        f"# autopar multi-device pipeline: {s} stages, {m} micro-batches, fill-drain (GPipe)",
        "def pipeline_step(stages, devices, streams, inputs, target, loss_fn):",
        f"    mbs = [tuple(t.to(devices[0]) for t in c) for c in _chunks(inputs, {m})]",
        f"    tgts = target.to(devices[{s - 1}]).chunk({m})",
        f"    acts = [[None] * {m} for _ in range({s})]",
        f"    events = [[None] * {m} for _ in range({s})]",
        "    acts[0] = mbs",
        "    total = None",
        f"    for tick in range({m + s - 1}):",
    ]
    for j in range(s):
        L += [
            f"        m = tick - {j}  # stage {j} on devices[{j}]",
            f"        if 0 <= m < {m}:",
            f"            if events[{j}][m] is not None:  # wait for the copy into devices[{j}]",
            f"                torch.cuda.current_stream(devices[{j}]).wait_event(events[{j}][m])",
            f"            y = stages[{j}](*acts[{j}][m])",
        ]
        if j < s - 1:
            L += [
                f"            s = streams[{j}]",
                "            if s is None:",
                f"                acts[{j + 1}][m] = (y.to(devices[{j + 1}]),)",
                "            else:  # copy on the side stream, overlapping the next compute",
                f"                s.wait_stream(torch.cuda.current_stream(devices[{j}]))",
                "                with torch.cuda.stream(s):",
                f"                    y2 = y.to(devices[{j + 1}], non_blocking=True)",
                f"                    acts[{j + 1}][m] = (y2,)",
                "                    y.record_stream(s)",
                "                    e = torch.cuda.Event()",
                "                    e.record(s)",
                f"                events[{j + 1}][m] = e",
            ]
        else:
            L += [
                f"            loss = loss_fn(y, tgts[m]) / {m}",
                "            total = loss if total is None else total + loss",
            ]
    L += ["    total.backward()", "    return total.detach()", ""]
    return "\n".join(L)


def _chunks(inputs: tuple, m: int) -> list[tuple]:
    parts = [x.chunk(m) for x in inputs]
    return [tuple(p[i] for p in parts) for i in range(m)]


def compile_multi_device(n_stages: int, microbatches: int):
    """(source, function) of ``multi_device_source``; what prints is what runs."""
    src = multi_device_source(n_stages, microbatches)
    ns = {"torch": torch, "_chunks": _chunks}
    exec(compile(src, f"<autopar multi-device pipeline {n_stages}x{microbatches}>", "exec"), ns)
    return src, ns["pipeline_step"]
