"""The fp64 oracle: is the compiled model no further from float64 than eager is?

Rule (docs/user-guide.md, "Correctness"): for every compared tensor (outputs, every
gradient, every parameter after an optimizer step)

    max|compiled - ref64| <= FACTOR * max|eager - ref64| + ATOL * (1 + max|ref64|)

with FACTOR = 2 and ATOL = 1e-6. The float64 reference is the same model, same
parameters, same inputs, run eagerly in float64. Reordered float accumulation (concurrent
streams, hoisted GEMMs) changes rounding, so "equal to eager" would be the wrong judge;
"as close to the truth as eager, within a factor" is the right one.
"""

from __future__ import annotations

import copy

import torch

FACTOR = 2.0
ATOL = 1e-6


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.detach().double() - ref.detach().double()).abs().max().item() if a.numel() else 0.0


def assert_close_to_oracle(name: str, got, eager, ref, factor=FACTOR, atol=ATOL):
    e_got, e_eager = max_err(got, ref), max_err(eager, ref)
    scale = ref.detach().double().abs().max().item() if ref.numel() else 0.0
    bound = factor * e_eager + atol * (1.0 + scale)
    assert e_got <= bound, (
        f"{name}: compiled error {e_got:.3e} vs fp64 exceeds {factor}x eager error "
        f"{e_eager:.3e} + {atol}*(1+{scale:.3g}) = {bound:.3e}"
    )


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flat(o)]
    return []


def _loss(outs, weights):
    return sum((o * w).sum() for o, w in zip(outs, weights, strict=True))


def _step(model, inputs, weights, opt_name):
    call, model = model, getattr(model, "_orig_mod", model)  # torch.compile's: same names
    out = _flat(call(*inputs))
    loss = _loss(out, weights)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    ins = [x.grad.detach().clone() if x.grad is not None else None for x in inputs]
    if opt_name:
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.1)
            if opt_name == "sgd"
            else torch.optim.Adam(model.parameters(), lr=1e-2)
        )
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [o.detach() for o in out], grads, ins, params


def check_training(model: torch.nn.Module, inputs, compile_fn, opt_name="sgd", seed=0):
    """Compare compiled vs eager vs fp64 on outputs, every gradient and one optimizer step.

    ``compile_fn(model) -> module`` compiles a deep copy; returns the compiled module."""
    eager = copy.deepcopy(model)
    ref = copy.deepcopy(model).double()
    comp_base = copy.deepcopy(model)
    comp = compile_fn(comp_base)

    def mk(dtype=None):
        xs = []
        for x in inputs:
            x = x.detach().clone()
            if dtype is not None and x.is_floating_point():
                x = x.to(dtype)
            if x.is_floating_point():
                x.requires_grad_(True)
            xs.append(x)
        return xs

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        probe = _flat(eager(*mk()))
    weights = [torch.randn(o.shape, generator=g) for o in probe]
    eager.load_state_dict(model.state_dict())  # undo any buffer update of the probe

    torch.manual_seed(seed)
    e = _step(eager, mk(), weights, opt_name)
    torch.manual_seed(seed)
    r = _step(ref, mk(torch.float64), [w.double() for w in weights], opt_name)
    torch.manual_seed(seed)
    c = _step(comp, mk(), weights, opt_name)

    assert len(c[0]) == len(e[0])
    for i, (cg, eg, rg) in enumerate(zip(c[0], e[0], r[0], strict=True)):
        assert cg.shape == eg.shape, f"output {i} shape {cg.shape} != {eg.shape}"
        assert_close_to_oracle(f"output {i}", cg, eg, rg)
    assert set(c[1]) == set(e[1]), f"gradients differ in which params: {set(c[1]) ^ set(e[1])}"
    for n in e[1]:
        assert_close_to_oracle(f"grad {n}", c[1][n], e[1][n], r[1][n])
    for i, (cg, eg, rg) in enumerate(zip(c[2], e[2], r[2], strict=True)):
        if eg is not None:
            assert cg is not None, f"input {i} got no gradient"
            assert_close_to_oracle(f"input grad {i}", cg, eg, rg)
    for n in e[3]:
        assert_close_to_oracle(f"param {n} after {opt_name}", c[3][n], e[3][n], r[3][n])
    return comp
