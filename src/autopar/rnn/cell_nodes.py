"""Fuse cell loops that Dynamo captured as ATen cells: ``torch.lstm_cell`` / ``torch.gru_cell``.

:func:`autopar.rnn.fuse.fuse_cell_loops` fuses the cells that
:func:`autopar.rnn.rewrite.rewrite_rnns` routes through autopar's custom ops, which
``autopar.compile`` does around every call. Under ``torch.compile(model,
backend="autopar")`` nothing wraps the module's call: Dynamo traces ``nn.LSTMCell`` /
``nn.GRUCell`` as one ATen cell node per step, and the loop stayed unfused (the LSTMCell
bench model: 14.1 ms a step against 11.2 ms under ``autopar.compile``, 2026-12-02). This pass
writes each such node as the rewrite would have traced it::

    h, c = torch.lstm_cell(x, (h0, c0), W_ih, W_hh, b_ih, b_hh)
 -> h, c = torch.ops.autopar.lstm_cell(F.linear(x, W_ih, b_ih), F.linear(h0, W_hh, b_hh), c0)

(the same for ``torch.gru_cell``, whose state is ``h0``), then runs ``fuse_cell_loops``. It
works on a copy: when no chain fuses, the graph stays exactly as Dynamo made it. Only 2-D
(batched) cells are written; the example values the fuse pass reads are made in the graph's
own fake mode.

Example::

    n = fuse_module_cells(gm)   # gm: a Dynamo FX graph; returns how many chains fused
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from autopar.rnn.fuse import _copy_graph, _value, fuse_cell_loops, graph_fake_mode

#: ATen's cells as Dynamo records them, and autopar's op for each.
_ATEN_CELLS = {torch.lstm_cell: "lstm", torch.gru_cell: "gru"}


def cell_passes(rnn: str = "unroll") -> tuple:
    """The pipeline's graph passes for option ``rnn``: with ``"unroll"``, loops of autopar's
    cell ops (``rewrite_rnns``, under ``autopar.compile``) and of ATen's (under
    ``backend="autopar"``) are fused; with ``"eager"`` only the former (none are made)."""
    return (fuse_cell_loops, fuse_module_cells) if rnn == "unroll" else (fuse_cell_loops,)


def fuse_module_cells(gm: fx.GraphModule) -> int:
    """Fuse the loops of ATen cells in ``gm`` (module docstring); returns how many chains
    fused. ``gm`` is unchanged when it returns 0."""
    if not any(n.op == "call_function" and n.target in _ATEN_CELLS for n in gm.graph.nodes):
        return 0
    fake_mode = graph_fake_mode(gm)
    if fake_mode is None:
        return 0
    graph = _copy_graph(gm.graph)
    written = sum(_write_cell(graph, n, fake_mode) for n in list(graph.nodes))
    if not written:
        return 0
    trial = fx.GraphModule(gm, graph)
    fused = fuse_cell_loops(trial)
    if fused:
        graph = trial.graph
        graph.owning_module = gm
        gm.graph = graph  # recompiles
    return fused


def _write_cell(graph: fx.Graph, node: fx.Node, fake_mode) -> bool:
    """Replace one ATen cell node by two ``F.linear`` nodes and autopar's cell op."""
    kind = _ATEN_CELLS.get(node.target) if node.op == "call_function" else None
    if kind is None or node.kwargs or len(node.args) != 6:
        return False
    x, state, w_ih, w_hh, b_ih, b_hh = node.args
    if kind == "lstm":
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            return False
        h0, keep = state
    else:
        h0 = keep = state
    values = [_value(a) for a in (x, h0, keep, w_ih, w_hh)]
    if any(v is None for v in values) or values[0].dim() != 2 or values[1].dim() != 2:
        return False
    bias = [_value(b) if isinstance(b, fx.Node) else None for b in (b_ih, b_hh)]
    if any(isinstance(b, fx.Node) and v is None for b, v in zip((b_ih, b_hh), bias, strict=True)):
        return False
    ops = torch.ops.autopar
    op = ops.lstm_cell.default if kind == "lstm" else ops.gru_cell.default
    with fake_mode:
        ig_v = F.linear(values[0], values[3], bias[0])
        hg_v = F.linear(values[1], values[4], bias[1])
        out_v = op(ig_v, hg_v, values[2])
    with graph.inserting_before(node):
        ig = graph.call_function(F.linear, (x, w_ih, b_ih))
        hg = graph.call_function(F.linear, (h0, w_hh, b_hh))
        cell = graph.call_function(op, (ig, hg, keep))
    for new, val in ((ig, ig_v), (hg, hg_v), (cell, out_v)):
        new.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
        new.meta["example_value"] = val
    node.replace_all_uses_with(cell)
    graph.erase_node(node)
    return True
