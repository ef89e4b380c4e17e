"""Triton cell kernels, run on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported and would change how every
later triton import in this pytest process behaves, so the checks run in a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install 'autopar[gpu]' or 'autopar[dev]')",
)

CHECKS = textwrap.dedent(
    """
    import torch
    from autopar.runtime.kernels import triton_cells as tc

    def lstm_ref(ig, hg, c):
        i, f, g, o = (ig + hg).chunk(4, -1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c_new), c_new

    def gru_ref(ig, hg, h):
        ir, iz, i_n = ig.chunk(3, -1)
        hr, hz, hn = hg.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * hn)
        return (1 - z) * n + z * h

    def close(a, b, what):
        err = (a.double() - b).abs().max().item()
        assert err <= 2e-6 * (1 + b.abs().max().item()), f"{what}: max error {err:.3g}"

    g = torch.Generator().manual_seed(0)
    # A ragged [rows, H] space with several programs (> BLOCK elements), and 3-D leading dims.
    for lead, hidden in [((7,), 5), ((3,), 700), ((2, 3), 4)]:
        for n, ref, fwd, bwd in [
            (4, lstm_ref, tc.lstm_cell_forward, tc.lstm_cell_backward),
            (3, gru_ref, tc.gru_cell_forward, tc.gru_cell_backward),
        ]:
            mk = lambda *s: 2 * torch.randn(*s, generator=g, dtype=torch.float64)
            ig, hg, st = mk(*lead, n * hidden), mk(*lead, n * hidden), mk(*lead, hidden)
            args64 = [t.clone().requires_grad_() for t in (ig, hg, st)]
            outs64 = ref(*args64)
            outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
            grads = [mk(*o.shape) for o in outs64]
            ref_grads = torch.autograd.grad(outs64, args64, grads)
            f32 = [t.float() for t in (ig, hg, st)]
            outs = fwd(*f32)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for k, (a, b) in enumerate(zip(outs, outs64)):
                assert a.dtype == torch.float32 and a.shape == b.shape
                close(a, b.detach(), f"{fwd.__name__} {lead} H={hidden} out{k}")
            got = bwd(*[t.float() for t in grads], *f32)
            if n == 4:  # LSTM: one grad_gates for igates and hgates, then grad_c
                got = (got[0], got[0], got[1])
            for k, (a, b) in enumerate(zip(got, ref_grads)):
                close(a, b, f"{bwd.__name__} {lead} H={hidden} grad{k}")

    # The custom ops' CUDA path dispatches to these kernels: force it on CPU tensors.
    import autopar.rnn.cells as rnn

    def op_fw_bw(op, *args):
        xs = [t.clone().requires_grad_() for t in args]
        outs = op(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        return [o.detach() for o in outs] + [x.grad for x in xs]

    ig, hg, c = (torch.randn(4, 4 * 6), torch.randn(4, 4 * 6), torch.randn(4, 6))
    cases = [(torch.ops.autopar.lstm_cell, (ig, hg, c)),
             (torch.ops.autopar.gru_cell, (ig[:, :18], hg[:, :18], c))]
    cpu = [op_fw_bw(op, *args) for op, args in cases]
    rnn._on_cuda = lambda *ts: True
    kern = [op_fw_bw(op, *args) for op, args in cases]
    for a_list, b_list in zip(kern, cpu):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(a_list, b_list))
    print("TRITON_CELLS_OK")
    """
)


def test_triton_cells_match_eager_math_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "TRITON_CELLS_OK" in proc.stdout, (
        f"interpreter checks failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
