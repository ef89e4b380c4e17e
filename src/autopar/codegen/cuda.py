"""Codegen for CUDA plans: one function enqueues every stream's work in plan order.

Built on ``autopar.codegen.emit`` (the shared schedule and statements);
``autopar.codegen.python.generate_python`` calls ``emit_cuda`` for plans whose streams
are on a CUDA device. Cross-stream edges become ``Event.record`` + ``wait_event``; a tensor
used on a stream other than the one that allocated it gets ``record_stream`` (so the caching
allocator does not hand its memory out while that stream may still read it); with
``cuda_graph=True`` the whole run is captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.codegen.emit import Stmt, call_expr, fmt, prologue, with_deletes


def emit_cuda(sched, plan, local, namer, inputs, out_node, cuda_graph, tag):
    """One function enqueueing every stream's work in plan order (no worker threads)."""
    stream, main = sched.stream, sched.main
    sv = {sid: f"s_{i}" for i, sid in enumerate(sched.stream_ids)}  # stream variables
    device = next(s.device for s in plan.streams if s.id == main)
    if device == "cuda":
        device = "cuda:0"
    ev_of = {p: i for i, p in enumerate(sched.signals)}
    ref = lambda n: local[n]
    params = [local[n] for n in inputs if n.op == "placeholder"]
    others = sched.stream_ids[1:]
    pre = [f"    {sv[main]} = torch.cuda.current_stream(torch.device({device!r}))"]
    if others:
        names = ", ".join(sv[s] for s in others)
        devs = ", ".join(repr(device) for _ in others)
        pre.append(f"    {names}, = _rt.cuda_streams(_STREAM_KEY, ({devs},))")
        pre.append(
            "    "
            + ";  ".join(f"{sv[s]}.wait_stream({sv[main]})" for s in others)
            + "  # inputs are ready on the caller's stream"
        )
    namer.globals["_STREAM_KEY"] = f"{tag}/{plan.plan_hash}"
    stmts: list[Stmt] = []
    current = main
    on_stream: set[tuple[fx.Node, int]] = set()  # (value, stream) already record_stream-ed
    for n in sched.compute:
        d = stream[n]
        if d != current:
            stmts.append(Stmt(f"torch.cuda.set_stream({sv[d]})"))
            current = d
        for p in sched.waits[n]:
            stmts.append(Stmt(f"{sv[d]}.wait_event(e_{ev_of[p]})  # after {p.name}"))
        for p in n.all_input_nodes:
            home = stream.get(p, main)  # inputs were allocated on the caller's stream
            if home != d and (p, d) not in on_stream:
                on_stream.add((p, d))  # the allocator must not reuse p before d is done
                stmts.append(Stmt(_record(p, local[p], sv[d]), [local[p]]))
        text = f"{local[n]} = {call_expr(n, ref, namer)}"
        if n in ev_of:
            i = ev_of[n]
            text += f";  e_{i} = torch.cuda.Event();  e_{i}.record({sv[d]})"
        stmts.append(Stmt(text, [local[p] for p in n.all_input_nodes], local[n], n))
    body = [Stmt(f"torch.cuda.set_stream({sv[main]})")] if current != main else []
    if others:
        joins = ";  ".join(f"{sv[main]}.wait_stream({sv[s]})" for s in others)
        body.append(Stmt(joins + "  # the caller's stream sees all work"))
    for p in dict.fromkeys(out_node.all_input_nodes):
        if stream.get(p, main) != main:
            body.append(Stmt(_record(p, local[p], sv[main]), [local[p]]))
    out = fmt(out_node.args[0], ref, namer)
    body.append(Stmt(f"return {out}", [local[p] for p in out_node.all_input_nodes]))
    all_stmts = with_deletes(stmts + body, set())
    fname = "_run" if cuda_graph else "forward"
    lines = [f"def {fname}({', '.join(params)}):", *prologue(inputs, local), *pre, "    try:"]
    owners: list = [None] * len(lines)
    for s in all_stmts[: len(stmts)]:
        lines.append(f"        {s.text}")
        owners.append(s.node)
    lines += ["    finally:", f"        torch.cuda.set_stream({sv[main]})"]
    owners += [None, None]
    for s in all_stmts[len(stmts) :]:
        if not s.text.startswith("torch.cuda.set_stream"):  # done by the finally block
            lines.append(f"    {s.text}")
            owners.append(None)
    if cuda_graph:
        tail = _cuda_graph_wrapper(params)
        lines += tail
        owners += [None] * len(tail)
    return lines, owners


def _record(node: fx.Node, name: str, stream_var: str) -> str:
    if isinstance(node.meta.get("val"), torch.Tensor):
        return f"{name}.record_stream({stream_var})"
    return f"_rt.record_streams({name}, {stream_var})"


def _cuda_graph_wrapper(params: list[str]) -> list[str]:
    """``forward`` capturing ``_run`` once in a CUDA graph, then replaying it."""
    p = ", ".join(params)
    return [
        "",
        "",
        "_GRAPH = {}  # captured on the first call: graph, static inputs, static outputs",
        "",
        "",
        f"def forward({p}):",
        f"    args = ({p}{',' if len(params) == 1 else ''})",
        '    if "graph" not in _GRAPH:',
        "        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]",
        "        side = torch.cuda.Stream()",
        "        side.wait_stream(torch.cuda.current_stream())",
        "        with torch.cuda.stream(side):  # warm-up outside capture (allocator, kernels)",
        "            for _ in range(3):",
        "                _run(*static)",
        "        torch.cuda.current_stream().wait_stream(side)",
        "        graph = torch.cuda.CUDAGraph()",
        "        with torch.cuda.graph(graph):",
        "            out = _run(*static)",
        "        _GRAPH.update(graph=graph, static=static, out=out)",
        '    for dst, src in zip(_GRAPH["static"], args):',
        "        if isinstance(dst, torch.Tensor):",
        "            dst.copy_(src)",
        '    _GRAPH["graph"].replay()',
        '    return _GRAPH["out"]',
    ]
