"""capture.analysis: the static write/alias/RNG analysis codegen, the pipeline and the
profiler share."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.capture import analysis


def test_inplace_views_and_rng():
    def f(x):
        v = x.view(-1)  # a view of the input
        v.add_(1)  # writes the input's buffer
        return torch.dropout(x.relu(), 0.5, True)

    gm = make_fx(f)(torch.ones(2, 2))
    nodes = {n.name: n for n in gm.graph.nodes}
    base, writes = analysis.buffer_analysis(list(gm.graph.nodes))
    assert base[nodes["view"]] is nodes["x_1"]  # a view shares its input's buffer
    assert writes[nodes["add_"]] == {nodes["x_1"]}  # written through the view
    # dropout decomposes into in-place ops on a fresh buffer, one of them random
    assert writes[nodes["bernoulli_"]] == writes[nodes["div_"]] == {nodes["empty_like"]}
    assert [n.name for n in gm.graph.nodes if analysis.is_rng(n)] == ["bernoulli_"]
    assert analysis.has_side_effects(gm)
    assert not analysis.has_side_effects(make_fx(lambda x: x.relu() + 1)(torch.ones(2)))
