"""Fuse unrolled ``nn.LSTMCell`` / ``nn.GRUCell`` time loops into one layer op per cell.

Under :func:`autopar.rnn.rewrite.rewrite_rnns` every ``nn.LSTMCell`` call traces in Dynamo as::

    igates = F.linear(x_t, W_ih, b_ih)
    hgates = F.linear(h_{t-1}, W_hh, b_hh)
    h_t, c_t = torch.ops.autopar.lstm_cell(igates, hgates, c_{t-1})

(an ``nn.GRUCell`` step is ``h_t = torch.ops.autopar.gru_cell(igates, hgates, h_{t-1})``).
A Python loop over T steps therefore leaves T such steps per cell in the Dynamo graph, which
AOTAutograd turns into ~30 forward and ~110 backward aten nodes per step (slow to trace,
slow to run). :func:`fuse_cell_loops` finds each *chain* of steps of one cell (same
weight nodes; step t's ``h_{t-1}`` and ``c_{t-1}`` are step t-1's outputs) and, when it is
safe, replaces it by::

    X = stack([x_0, ..., x_{T-1}])      # [T, B, I]; x.transpose(0, 1) for x[:, t]; a fused
                                        # layer's own ``out`` when x_t are its unbound steps
    out, hy, cy = autopar.rnn.cells.fused_lstm_layer(X, W_ih, W_hh, b_ih, b_hh, h0, c0)
    h_t = unbind(out)[t]                # only for the h_t that have users
    c_{T-1} = cy

``fused_lstm_layer`` is ONE ``aten.mkldnn_rnn_layer`` call (wrapped in the custom op
``autopar::mkldnn_rnn_layer`` so oneDNN's workspace survives AOTAutograd's no-grad forward),
so AOTAutograd traces ONE forward and ONE backward node per layer, with the same numerics as
``nn.LSTM`` on CPU. A GRU chain becomes ``out, hy = autopar.rnn.gru.fused_gru_layer(X, W_ih,
W_hh, b_ih, b_hh, h0)`` (``autopar::gru_layer``: ATen's GRU loop forward, one-op backward).

Safety (a chain that fails any of these is left as it is):

* T >= 2; every step uses the same weight/bias nodes (biases both present or both absent);
* CPU float32 2-D ``[B, I]`` inputs, ``[B, H]`` states, and (LSTM) ``torch.backends.mkldnn``;
  under ``torch.autocast`` a float32 loop qualifies too (only its gate GEMMs were lower
  precision): the fused layer runs in float32, and returns float32 as the eager cells do
  there (their state math promotes, see ``rnn.cells``), with less rounding than eager;
* no external input of the chain (``x_t``, ``h0``, ``c0``, weights) depends on a node of the
  chain (no feedback, e.g. a decoder feeding its output back as the next input);
* the intermediate ``c_t`` (t < T-1) and the gate GEMMs have no users outside the chain;
* the graph holds no mutation, random or other side-effecting op (fusing reorders nodes,
  which would change in-place semantics or the order random numbers are drawn in).

``chunks=k`` splits each chain into k consecutive time chunks (one fused call each, the
next chunk starting from the previous chunk's ``hy``/``cy``), so the planner can run chunk j
of layer l+1 concurrently with chunk j+1 of layer l (a layer x time wavefront).

Example::

    n = fuse_cell_loops(gm)   # gm: a Dynamo FX graph; returns how many chains fused
"""

from __future__ import annotations

import copy
import heapq
import itertools
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from autopar import compat
from autopar.rnn.cells import fused_lstm_layer
from autopar.rnn.gru import fused_gru_layer

__all__ = ["fuse_cell_loops"]

log = logging.getLogger(__name__)

_LINEAR = (compat.nn_linear, F.linear)
# Name tokens of ops that draw random numbers (torch-level functions and methods).
_RANDOM = {
    "rand", "randn", "randint", "randperm", "random", "normal", "uniform", "bernoulli",
    "multinomial", "poisson", "exponential", "cauchy", "geometric", "rrelu",
    "dropout", "dropout1d", "dropout2d", "dropout3d",
}  # fmt: skip
_INPLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
    operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
}  # fmt: skip


# --------------------------------------------------------------------------- the pass


def _cell_kind(node: fx.Node) -> str | None:
    """``"lstm"`` / ``"gru"`` for an ``autopar::lstm_cell`` / ``autopar::gru_cell`` call."""
    if node.op != "call_function":
        return None
    lstm, gru = torch.ops.autopar.lstm_cell, torch.ops.autopar.gru_cell
    kinds = {lstm: "lstm", lstm.default: "lstm", gru: "gru", gru.default: "gru"}
    return kinds.get(node.target)


@dataclass
class _Step:
    """One cell call and the two gate GEMMs feeding it (``c_prev`` is None for a GRU)."""

    kind: str
    cell: fx.Node
    igates: fx.Node
    hgates: fx.Node
    x: fx.Node
    h_prev: fx.Node
    c_prev: fx.Node | None
    weights: tuple  # (w_ih, w_hh, b_ih, b_hh); biases may be None
    # LSTM: getitem(cell, 0) / getitem(cell, 1) nodes; GRU: the cell node itself is h_t
    h_outs: list[fx.Node] = field(default_factory=list)
    c_outs: list[fx.Node] = field(default_factory=list)


def _linear_args(node: fx.Node):
    """(input, weight, bias) of an ``F.linear`` node, or None."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    names = ("input", "weight", "bias")
    for i, name in enumerate(names):
        if name in node.kwargs:
            args[i] = node.kwargs[name]
    if len(node.args) > 3 or set(node.kwargs) - set(names):
        return None
    inp, weight, bias = args[:3]
    if not isinstance(inp, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if bias is not None and not isinstance(bias, fx.Node):
        return None
    return inp, weight, bias


def _parse_step(cell: fx.Node) -> _Step | None:
    kind = _cell_kind(cell)
    if kind is None or len(cell.args) != 3 or cell.kwargs:
        return None
    ig, hg, state = cell.args
    if not all(isinstance(n, fx.Node) for n in (ig, hg, state)) or ig is hg:
        return None
    ia, ha = _linear_args(ig), _linear_args(hg)
    if ia is None or ha is None or set(ig.users) != {cell} or set(hg.users) != {cell}:
        return None
    weights = (ia[1], ha[1], ia[2], ha[2])
    if kind == "gru":  # the state the cell blends must be the h its hgates GEMM read
        if ha[0] is not state:
            return None
        return _Step(kind, cell, ig, hg, ia[0], state, None, weights, [cell])
    step = _Step(kind, cell, ig, hg, ia[0], ha[0], state, weights)
    for user in cell.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        if user.args[1] == 0:
            step.h_outs.append(user)
        elif user.args[1] == 1:
            step.c_outs.append(user)
        else:
            return None
    return step


def _find_chains(graph: fx.Graph) -> list[list[_Step]]:
    """Maximal chains of steps of one cell, in graph order of their first step."""
    steps = {}
    for node in graph.nodes:
        step = _parse_step(node)
        if step is not None:
            steps[node] = step
    succ: dict[fx.Node, list[_Step]] = {}
    pred: dict[fx.Node, _Step] = {}
    for step in steps.values():
        prev = _previous_step(step, steps)
        if prev is None or prev.kind != step.kind or prev.weights != step.weights:
            continue
        succ.setdefault(prev.cell, []).append(step)
        pred[step.cell] = prev
    chains = []
    for step in steps.values():
        prev = pred.get(step.cell)
        if prev is not None and len(succ[prev.cell]) == 1:
            continue  # not the first step of its chain
        chain = [step]
        while len(succ.get(chain[-1].cell, ())) == 1:
            chain.append(succ[chain[-1].cell][0])
        chains.append(chain)
    return chains


def _previous_step(step: _Step, steps: dict) -> _Step | None:
    """The step whose outputs are this step's state (h_{t-1}, c_{t-1}), if any."""
    hp, cp = step.h_prev, step.c_prev
    if cp is None:  # GRU: h_{t-1} is the previous cell node itself
        return steps.get(hp)
    if not (hp.op == cp.op == "call_function" and hp.target is cp.target is operator.getitem):
        return None
    prev = steps.get(hp.args[0])
    if prev is None or cp.args[0] is not prev.cell or hp.args[1] != 0 or cp.args[1] != 1:
        return None
    return prev


def graph_fake_mode(gm: fx.GraphModule):
    """The fake mode ``gm``'s example values live in (not the tracing context's: AOTAutograd
    gets a fresh one), or None."""
    modes = (getattr(_value(n), "fake_mode", None) for n in gm.graph.nodes)
    return next((m for m in modes if m is not None), None)


def _value(node) -> torch.Tensor | None:
    val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _shapes_ok(chain: list[_Step]) -> bool:
    w_ih, w_hh, b_ih, b_hh = chain[0].weights
    if (b_ih is None) != (b_hh is None):
        return False
    lstm = chain[0].kind == "lstm"
    if lstm and not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    gates = 4 if lstm else 3
    c_prev = chain[0].c_prev if lstm else chain[0].h_prev  # (a GRU has h only)
    vals = [_value(n) for n in (w_ih, w_hh, chain[0].h_prev, c_prev)]
    vals += [_value(s.x) for s in chain]
    vals += [_value(b) for b in (b_ih, b_hh) if b is not None]
    if any(v is None or v.dtype != torch.float32 or v.device.type != "cpu" for v in vals):
        return False
    wi, wh, h0, c0 = vals[:4]
    x0 = vals[4]
    if x0.dim() != 2 or h0.dim() != 2 or wi.dim() != 2 or wh.dim() != 2:
        return False
    batch, hidden = h0.shape
    if tuple(c0.shape) != (batch, hidden) or tuple(wh.shape) != (gates * hidden, hidden):
        return False
    if tuple(wi.shape) != (gates * hidden, x0.shape[1]) or x0.shape[0] != batch:
        return False
    if any(tuple(v.shape) != tuple(x0.shape) for v in vals[4 : 4 + len(chain)]):
        return False
    return all(tuple(b.shape) == (gates * hidden,) for b in vals[4 + len(chain) :])


def _chain_nodes(chain: list[_Step]) -> set[fx.Node]:
    nodes = set()
    for s in chain:
        nodes.update((s.cell, s.igates, s.hgates, *s.h_outs, *s.c_outs))
    return nodes


def _external_inputs(chain: list[_Step]) -> list[fx.Node]:
    ins = [s.x for s in chain] + [chain[0].h_prev, chain[0].c_prev, *chain[0].weights]
    return [n for n in ins if n is not None]


def _depends_on(starts: list[fx.Node], targets: set[fx.Node]) -> bool:
    seen, stack = set(), list(starts)
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return False


def _safe(chain: list[_Step]) -> bool:
    if len(chain) < 2 or not _shapes_ok(chain):
        return False
    nodes = _chain_nodes(chain)
    for step, nxt in itertools.pairwise(chain):
        # c_t feeds only the next step; h_t may have outside users (they get out[t]).
        if any(set(c.users) - {nxt.cell} for c in step.c_outs):
            return False
    return not _depends_on(_external_inputs(chain), nodes)


def _token_names(target) -> set[str]:
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return set(name.split(".")[0].strip("_").split("_")) | {name.split(".")[0].strip("_")}


def _order_sensitive(node: fx.Node) -> bool:
    """Nodes whose position relative to others matters: mutation, randomness, global state."""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op == "call_module":
        return True  # unknown module: assume the worst
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return (
            (name.endswith("_") and not name.startswith("__"))
            or bool(_token_names(name) & _RANDOM)
            or name in ("__setitem__", "__delitem__")
        )
    if node.target in _INPLACE_OPERATORS:
        return True
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.startswith("__") or _token_names(node.target) & _RANDOM:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    try:
        return node.is_impure(impure_random=True)
    except Exception:  # noqa: BLE001 - cannot tell: assume it matters
        return True


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes keep their extra attributes too (Dynamo sets
    ``_dynamo_source`` on placeholders, which AOTAutograd reads)."""
    new = copy.deepcopy(graph)
    for old, node in zip(graph.nodes, new.nodes, strict=True):  # same order
        for key, value in vars(old).items():
            if key not in vars(node):
                setattr(node, key, value)
    return new


def _erase_dead(graph: fx.Graph) -> None:
    """Erase the pure glue this pass leaves dead (selects, unbinds, contiguous, transposes)."""
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        if node.op == "call_function" and node.target in (operator.getitem, torch.unbind):
            graph.erase_node(node)
        elif node.op == "call_method" and node.target in ("contiguous", "transpose"):
            graph.erase_node(node)


def _toposort(graph: fx.Graph) -> None:
    """Stable topological order (ties keep the original order); raises on a cycle."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    indeg = {n: len(n.all_input_nodes) for n in nodes}
    ready = [index[n] for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for user in node.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                heapq.heappush(ready, index[user])
    if len(order) != len(nodes):
        raise RuntimeError("rnn_fuse: fusing would create a cycle")
    if order != nodes:
        end = graph.output_node()
        for node in order:
            if node is not end:
                end.prepend(node)


def _x_source(xs: list[fx.Node]) -> fx.Node | None:
    """``x`` when ``xs`` are exactly ``x[:, 0], ..., x[:, T-1]`` of a 3-D ``[B, T, I]`` x."""
    src = xs[0].args[0] if xs[0].args else None
    val = _value(src)
    if val is None or val.dim() != 3 or val.shape[1] != len(xs):
        return None
    for t, x in enumerate(xs):
        if x.op != "call_function" or x.target is not operator.getitem or x.args[0] is not src:
            return None
        idx = x.args[1]
        if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None) and idx[1] == t):
            return None
    return src


def _unbound_source(xs: list[fx.Node]) -> fx.Node | None:
    """``out`` when ``xs`` are all of ``torch.unbind(out, 0)`` in order (a fused layer below)."""
    hs = xs[0].args[0] if xs[0].args else None
    if not isinstance(hs, fx.Node) or hs.target is not torch.unbind or hs.args[1:] != (0,):
        return None
    val = _value(hs.args[0])
    if val is None or val.shape[0] != len(xs):
        return None
    for t, x in enumerate(xs):
        if x.op != "call_function" or x.target is not operator.getitem or x.args != (hs, t):
            return None
    return hs.args[0]


class _Builder:
    """Creates nodes right after an anchor, with example values and the user's stack trace."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, meta: dict, fake_mode):
        self.graph, self.anchor, self.meta, self.fake_mode = graph, anchor, meta, fake_mode

    def __call__(self, op: str, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        with self.graph.inserting_after(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs or {})
        self.anchor = node
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.meta:
                node.meta[key] = self.meta[key]
        node.meta["example_value"] = self._example(op, target, args, kwargs or {})
        return node

    def _example(self, op, target, args, kwargs):
        def ev(a):
            return a.meta.get("example_value") if isinstance(a, fx.Node) else a

        args, kwargs = fx.node.map_aggregate(args, ev), fx.node.map_aggregate(kwargs, ev)
        with self.fake_mode:
            if op == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            return target(*args, **kwargs)


def _fuse_chain(graph: fx.Graph, chain: list[_Step], chunks: int, fake_mode) -> None:
    w_ih, w_hh, b_ih, b_hh = chain[0].weights
    position = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max(_external_inputs(chain), key=position.__getitem__)
    make = _Builder(graph, anchor, chain[0].cell.meta, fake_mode)
    steps, xs_all = len(chain), None
    src = _x_source([s.x for s in chain])
    if src is not None:  # x[:, t] for every t: one transpose instead of T selects + stack
        xs_all = make("call_method", "transpose", (src, 0, 1))
    lstm = chain[0].kind == "lstm"
    h = make("call_method", "contiguous", (chain[0].h_prev,))
    c = make("call_method", "contiguous", (chain[0].c_prev,)) if lstm else None
    nodes = _chain_nodes(chain)
    bounds = [steps * j // chunks for j in range(chunks + 1)]
    for lo, hi in itertools.pairwise(bounds):
        xs = _unbound_source([s.x for s in chain[lo:hi]])
        if xs is None and xs_all is not None:
            xs = (
                xs_all
                if chunks == 1
                else make("call_function", operator.getitem, (xs_all, slice(lo, hi)))
            )
        elif xs is None:
            xs = make("call_function", torch.stack, ([s.x for s in chain[lo:hi]],), {"dim": 0})
        # oneDNN reads raw memory: its inputs must be contiguous (no-op when they are).
        xs = make("call_method", "contiguous", (xs,))
        if lstm:
            res = make("call_function", fused_lstm_layer, (xs, w_ih, w_hh, b_ih, b_hh, h, c))
            c = make("call_function", operator.getitem, (res, 2))
        else:
            res = make("call_function", fused_gru_layer, (xs, w_ih, w_hh, b_ih, b_hh, h))
        out = make("call_function", operator.getitem, (res, 0))
        h = make("call_function", operator.getitem, (res, 1))
        hs = None
        for t in range(lo, hi):
            for h_out in chain[t].h_outs:
                if not set(h_out.users) - nodes:
                    continue
                if hs is None:
                    hs = make("call_function", torch.unbind, (out, 0))
                h_t = make("call_function", operator.getitem, (hs, t - lo))
                h_out.replace_all_uses_with(h_t, delete_user_cb=lambda u: u not in nodes)
    for c_out in chain[-1].c_outs:
        c_out.replace_all_uses_with(c)
    for step in reversed(chain):  # (a GRU step's h_out is its cell: erase each node once)
        dead = (*step.h_outs, *step.c_outs, step.cell, step.hgates, step.igates)
        for node in dict.fromkeys(dead):
            graph.erase_node(node)
    for x in {s.x for s in chain}:  # the x[:, t] selects, now dead when transposed
        if not x.users and x.op == "call_function" and x.target is operator.getitem:
            graph.erase_node(x)
    _toposort(graph)


def fuse_cell_loops(gm: fx.GraphModule, chunks: int = 1) -> int:
    """Replace each safe chain of ``autopar::lstm_cell`` / ``autopar::gru_cell`` steps by
    fused layer call(s) (see the module docstring); returns how many chains were fused.
    ``chunks``: time chunks per chain (``min(chunks, T)``), one fused call each. The graph is
    unchanged when it returns 0; otherwise it is linted and recompiled."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    chains = _find_chains(gm.graph)
    if not any(len(c) >= 2 for c in chains):
        return 0
    if any(_order_sensitive(n) for n in gm.graph.nodes):
        log.debug("rnn_fuse: graph has mutation/random/side-effect ops; not fusing")
        return 0
    fake_mode = graph_fake_mode(gm)
    if fake_mode is None:
        return 0
    # Work on a copy: any failure leaves ``gm`` exactly as it was.
    graph = _copy_graph(gm.graph)
    fused = 0
    while True:  # re-find after each fusion: it changes dependencies (e.g. new cycles)
        chain = next((c for c in _find_chains(graph) if _safe(c)), None)
        if chain is None:
            break
        _fuse_chain(graph, chain, min(chunks, len(chain)), fake_mode)
        fused += 1
    if fused:
        _erase_dead(graph)
        graph.owning_module = gm
        graph.lint()
        gm.graph = graph  # recompiles
    return fused
